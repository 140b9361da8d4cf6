"""`specrt bench --report DIR`: a profile and roofline report of one benchmark run.

    report.md                   tables: configs, tokens/s by category, acceptance by draft depth,
                                time per stage (ms per generated token), the roofline
    report.json                 the benchmark result, the derived profile and the roofline
    tokens_per_s.png            grouped bars: tokens/s by engine and prompt category
    acceptance_by_position.png  share of verify steps accepting a draft at depth 1, 2, ...
    stage_time.png              stacked bars: ms per generated token in each stage

The files are written into a temporary folder beside DIR, then renamed into place: DIR appears
whole, or an existing DIR has each report file replaced at once; never a half-written file.
Python overhead is what the stage timers do not cover: row seconds − Σ stage seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from specrt.errors import SpecrtError

STAGES = ("prefill", "propose", "verify", "accept", "commit")
OVERHEAD = "python_overhead"
REPORT_FILES = ("report.md", "report.json", "tokens_per_s.png", "acceptance_by_position.png",
                "stage_time.png")


# ── the profile ───────────────────────────────────────────────────────────────────────────────
def engines_in_order(result: dict) -> list[str]:
    """specrt configs, then peers, then any other engine the rows name."""
    cfg = result.get("config", {})
    names = list(cfg.get("configs", [])) + list(cfg.get("peers", []))
    for r in result.get("rows", []):
        if r["drafter"] not in names:
            names.append(r["drafter"])
    return names


def row_overhead(row: dict) -> float | None:
    """Seconds of a run outside every timed stage; None for rows without stage times (peers)."""
    stages = row.get("stage_seconds")
    if not stages:
        return None
    return row["seconds"] - sum(stages.values())


def stage_breakdown(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per engine with stage times: ms per generated token in each stage, Python overhead and total."""
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    tokens: dict[str, int] = defaultdict(int)
    for r in rows:
        overhead = row_overhead(r)
        if overhead is None:
            continue
        for stage, sec in r["stage_seconds"].items():
            sums[r["drafter"]][stage] += sec
        sums[r["drafter"]][OVERHEAD] += overhead
        sums[r["drafter"]]["total"] += r["seconds"]
        tokens[r["drafter"]] += r["new_tokens"]
    out = {}
    for name, s in sums.items():
        keys = [*STAGES, *(k for k in s if k not in (*STAGES, OVERHEAD, "total")), OVERHEAD, "total"]
        out[name] = {k: round(1000 * s.get(k, 0.0) / tokens[name], 4) if tokens[name] else 0.0 for k in keys}
    return out


def tokens_per_s_by_category(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per engine and category: the median over prompts of each prompt's median tokens/s over repeats."""
    per_prompt: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        per_prompt[(r["drafter"], r["category"], r["id"])].append(r["tokens_per_s"])
    per_cat: dict[tuple, list[float]] = defaultdict(list)
    for (name, cat, _), v in per_prompt.items():
        per_cat[(name, cat)].append(statistics.median(v))
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for (name, cat), v in per_cat.items():
        out[name][cat] = round(statistics.median(v), 2)
    return dict(out)


def categories(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["category"] for r in rows))


def profile(result: dict) -> dict:
    return {"stage_ms_per_token": stage_breakdown(result.get("rows", [])),
            "tokens_per_s_by_category": tokens_per_s_by_category(result.get("rows", []))}


# ── markdown ──────────────────────────────────────────────────────────────────────────────────
def _fmt(v, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _speedup(entry: dict):
    if entry.get("speedup_vs_plain") is not None:
        return entry["speedup_vs_plain"]
    vs = entry.get("speedup_vs")
    return vs.get("plain") if isinstance(vs, dict) else vs


def engines_section(result: dict) -> str:
    summary = result.get("summary", {})
    peers = list(result.get("config", {}).get("peers", []))
    rows = []
    for name in engines_in_order(result):
        s = summary.get(name)
        if s is None:
            continue
        vs = s.get("speedup_vs") if isinstance(s.get("speedup_vs"), dict) else {}
        rows.append([name, _fmt(s.get("tokens_per_s_median"), ".1f"), _fmt(s.get("tokens_per_s_min"), ".1f"),
                     _fmt(s.get("tokens_per_s_max"), ".1f"), _fmt(_speedup(s)),
                     *(_fmt(vs.get(p)) for p in peers), _fmt(s.get("mean_accepted_len")),
                     _fmt(s.get("identical")), _fmt(s.get("held_to")), _fmt(s.get("same_as_specrt_plain"))])
    header = ["engine", "tok/s median", "min", "max", "× plain", *(f"× {p}" for p in peers), "τ", "identical",
              "held to", "= specrt plain"]
    return "## Engines\n\n" + md_table(header, rows) + references_note(summary)


def references_note(summary: dict) -> str:
    """What each engine an `identical` column is held to is (where the run knows it)."""
    refs = {s["held_to"]: s["held_to_is"] for s in summary.values() if s.get("held_to_is")}
    if not refs:
        return ""
    lines = [f"- `{name}`: {text}" for name, text in refs.items()]
    lines += [f"- `{name}` is a different reference from `plain` (its plain output differs on "
              f"{s['prompts_differing']} prompt(s)): each engine is exact to its own reference, not to the other's"
              for name, s in summary.items() if s.get("different_reference") and s.get("prompts_differing")
              and name == s.get("held_to")]  # a plain peer's own line (not its per-category ones)
    return "\n\nEach engine's `identical` is checked against the engine in `held to`:\n\n" + "\n".join(lines)


def category_section(result: dict, by_cat: dict) -> str:
    cats = categories(result.get("rows", []))
    rows = [[name, *(_fmt(by_cat[name].get(c), ".1f") for c in cats)]
            for name in engines_in_order(result) if name in by_cat]
    return "## Tokens/s by prompt category (median over prompts)\n\n" + md_table(["engine", *cats], rows)


def acceptance_section(result: dict) -> str:
    summary = result.get("summary", {})
    acc = {n: (summary.get(n) or {}).get("acceptance_by_position") or [] for n in engines_in_order(result)}
    acc = {n: a for n, a in acc.items() if a}
    depth = max((len(a) for a in acc.values()), default=0)
    if not depth:
        return "## Acceptance by draft position\n\nNo engine accepted a drafted token."
    rows = [[n, *(_fmt(a[d] if d < len(a) else 0.0) for d in range(depth))] for n, a in acc.items()]
    return ("## Acceptance by draft position\n\nShare of verify steps that accepted a draft at depth d "
            "(τ = 1 + their sum).\n\n" + md_table(["engine", *(str(d + 1) for d in range(depth))], rows))


def stage_section(stages: dict) -> str:
    if not stages:
        return "## Time per stage\n\nNo engine reported stage times."
    keys = [k for k in next(iter(stages.values())) if k != "total"]
    rows = [[n, *(_fmt(s.get(k), ".3f") for k in keys), _fmt(s.get("total"), ".3f")]
            for n, s in stages.items()]
    return ("## Time per stage (ms per generated token)\n\n"
            "Python overhead = run seconds − Σ stage seconds.\n\n"
            + md_table(["engine", *(k.replace("_", " ") for k in keys), "total"], rows))


def _mb(n) -> str:
    return f"{n / 1e6:.1f}"


def roofline_section(roofline: dict | None) -> str:
    if not roofline:
        return "## Roofline\n\nNot measured."
    head = ("## Roofline (memory-bandwidth bound)\n\n"
            f"Measured bandwidth: **{roofline['bandwidth_gb_s']:.2f} GB/s** "
            f"({roofline.get('bandwidth_method', '')}).\nTarget weights streamed per pass: "
            f"{_mb(roofline['target']['streamed_bytes'])} MB; KV per token: "
            f"{roofline['target']['kv_bytes_per_token'] / 1e3:.1f} kB.")
    if roofline["target"].get("nodes"):
        top = ", ".join(f"{op} {n}" for op, n in list(roofline["target"]["ops"].items())[:6])
        head += f" Nodes per target pass: {roofline['target']['nodes']} ({top}, …)."
    gathered = {**roofline["target"].get("gathered", {})}
    for g in roofline.get("drafter_graphs", {}).values():
        gathered.update(g.get("gathered", {}))
    if gathered:
        head += " Read by Gather only (rows, not counted): " + ", ".join(
            f"{k} ({_mb(v)} MB)" for k, v in gathered.items()) + "."
    rows = [[n, _mb(e["bytes_per_step"]), _mb(e["parts"]["target_weights"]), _mb(e["parts"]["target_kv"]),
             _mb(e["parts"]["drafter_weights"] + e["parts"]["drafter_kv"]), _fmt(e["tokens_per_step"]),
             _fmt(e["bound_tokens_per_s"], ".1f"), _fmt(e["measured_tokens_per_s"], ".1f"),
             _fmt(None if e["fraction_of_bound"] is None else 100 * e["fraction_of_bound"], ".1f"),
             _fmt(e["measured_gb_s"])]
            for n, e in roofline.get("configs", {}).items()]
    header = ["engine", "MB/step", "target weights", "target KV", "drafter", "tokens/step", "bound tok/s",
              "measured decode tok/s", "% of bound", "measured GB/s"]
    notes = ("\n\nbound = tokens/step × bandwidth ÷ bytes/step. tokens/step = decode tokens ÷ verify steps "
             "over all runs (weighted by steps, unlike τ above, a mean of per-run values); measured leaves "
             "prefill out. Drafter bytes assume its nominal depth every step (an upper bound); MB = 1e6 bytes.")
    if roofline.get("peers"):
        notes += f" Peers ({', '.join(roofline['peers'])}) run their own weights: not modelled."
    return head + "\n\n" + md_table(header, rows) + notes


def config_section(result: dict) -> str:
    cfg = result.get("config", {})
    return "## Configuration\n\n" + "\n".join(f"- {k}: {v}" for k, v in cfg.items())


def auto_section(result: dict) -> str:
    """`--drafter auto` rows: the drafter each request chose, why, and the pay-offs S it compared."""
    rows = [[r["drafter"], r["id"], r["repeat"], r["auto"]["drafter"], r["auto"]["reason"],
             ", ".join(f"{d} {_fmt(s)}" for d, s in r["auto"]["speedup"].items()),
             _fmt(r.get("tokens_per_s"), ".1f"), _fmt(r.get("mean_accepted_len"))]
            for r in result.get("rows", []) if r.get("auto")]
    if not rows:
        return ""
    return ("## Drafter chosen per request (auto)\n\nPay-off S: predicted tokens/s over plain decoding's, "
            "as measured before the request (- : not measured yet).\n\n"
            + md_table(["engine", "prompt", "repeat", "drafter", "reason", "pay-offs S", "tok/s", "τ"], rows))


def render_markdown(result: dict, prof: dict, roofline: dict | None) -> str:
    parts = ["# specrt bench report", config_section(result), engines_section(result), auto_section(result),
             category_section(result, prof["tokens_per_s_by_category"]), acceptance_section(result),
             stage_section(prof["stage_ms_per_token"]), roofline_section(roofline),
             "## Plots\n\n![tokens/s](tokens_per_s.png)\n\n![acceptance](acceptance_by_position.png)\n\n"
             "![stage time](stage_time.png)"]
    return "\n\n".join(p for p in parts if p) + "\n"


# ── plots ─────────────────────────────────────────────────────────────────────────────────────
def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SpecrtError("--report draws its plots with matplotlib, which is not installed: "
                          "`pip install matplotlib`") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_tokens_per_s(result: dict, by_cat: dict, path: Path) -> None:
    plt = pyplot()
    names = [n for n in engines_in_order(result) if n in by_cat]
    cats = categories(result.get("rows", []))
    fig, ax = plt.subplots(figsize=(max(7.0, 1.0 + 0.35 * len(names) * max(len(cats), 1)), 4.5))
    width = 0.8 / max(len(names), 1)
    peers = set(result.get("config", {}).get("peers", []))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colours; peers hatched
    for i, name in enumerate(names):
        xs = [c + (i - (len(names) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [by_cat[name].get(c, 0.0) for c in cats], width, label=name, color=colors[i % len(colors)],
               hatch="//" if name in peers else None, edgecolor="white" if name in peers else None)
    ax.set_xticks(range(len(cats)), cats)
    ax.set_ylabel("tokens/s (median over prompts)")
    ax.set_title("Tokens/s by engine and prompt category")
    _legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def plot_acceptance(result: dict, path: Path) -> None:
    plt = pyplot()
    summary = result.get("summary", {})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for name in engines_in_order(result):
        acc = (summary.get(name) or {}).get("acceptance_by_position") or []
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
            drawn += 1
    if drawn:
        _legend_outside(ax)
        ax.xaxis.get_major_locator().set_params(integer=True)
    else:
        ax.text(0.5, 0.5, "no drafted token was accepted", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("share of verify steps accepting it")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by draft position")
    ax.grid(alpha=0.3)
    _save(fig, path)


def plot_stage_time(stages: dict, path: Path) -> None:
    plt = pyplot()
    names = list(stages)
    keys = [k for k in (next(iter(stages.values())) if stages else {}) if k != "total"]
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(names)), 4.5))
    bottom = [0.0] * len(names)
    for k in keys:
        vals = [max(stages[n].get(k, 0.0), 0.0) for n in names]
        ax.bar(names, vals, bottom=bottom, label=k.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (x, total), ha="center", va="bottom", fontsize="small")
    if not names:
        ax.text(0.5, 0.5, "no stage times", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("ms per generated token")
    ax.set_title("Time per stage (ms per generated token)")
    _legend_outside(ax)
    ax.grid(axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelrotation=20)
    _save(fig, path)


def _legend_outside(ax) -> None:
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clear()
    import matplotlib.pyplot as plt

    plt.close(fig)


# ── writing ───────────────────────────────────────────────────────────────────────────────────
def write_files(folder: Path, result: dict, prof: dict, roofline: dict | None) -> None:
    plot_tokens_per_s(result, prof["tokens_per_s_by_category"], folder / "tokens_per_s.png")
    plot_acceptance(result, folder / "acceptance_by_position.png")
    plot_stage_time(prof["stage_ms_per_token"], folder / "stage_time.png")
    payload = {"result": result, "profile": prof, "roofline": roofline}
    (folder / "report.json").write_text(json.dumps(payload, indent=2, default=str))
    (folder / "report.md").write_text(render_markdown(result, prof, roofline))


def publish(tmp: Path, out_dir: Path) -> None:
    """Move the finished files into place: rename the folder if DIR is absent, else file by file."""
    try:
        os.rename(tmp, out_dir)
        return
    except OSError:
        if not out_dir.is_dir():
            raise
    for name in REPORT_FILES:
        os.replace(tmp / name, out_dir / name)
    shutil.rmtree(tmp)


def write_report(result: dict, out_dir: Path, roofline: dict | None = None) -> Path:
    """Write the report of a `run_bench` result (and its roofline) into `out_dir`; returns it."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise SpecrtError(f"--report {out_dir} is a file: give a folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would otherwise become the report folder's
        write_files(tmp, result, profile(result), roofline)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
