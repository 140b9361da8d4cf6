"""Side-by-side benchmark: every drafter (and optional peers) on the same prompts, interleaved.

Ratios are measured in one process after a warm-up; `speedup_vs_plain` is the median over prompts
of (drafter tokens/s ÷ plain tokens/s), each prompt's tokens/s being the median over repeats.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams


@dataclass
class Prompt:
    id: str
    category: str
    prompt: str


def load_prompts(path: Path, split: str | None = None, per_category: int | None = None) -> list[Prompt]:
    """Prompts from a JSONL file; `split` keeps rows whose "split" matches (the training corpus's
    "heldout" prompts), `per_category` the first N of each category."""
    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"prompts file {path} does not exist: pass a JSONL file with one {{\"prompt\": ...}} per line")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecrtError(f"{path}:{n}: not valid JSON ({e.msg}): each line must be a JSON object") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise SpecrtError(f"{path}:{n}: each line needs a string field \"prompt\"")
        if split is not None and obj.get("split") != split:
            continue
        prompts.append(Prompt(str(obj.get("id", n)), str(obj.get("category", "default")), obj["prompt"]))
    if per_category:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            seen[p.category] += 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise SpecrtError(f"{path} holds no prompts" + (f" of split {split!r}" if split else ""))
    return prompts


# A peer runs the same prompt token ids with another engine: (ids, max_new_tokens) -> (new ids, seconds).
Peer = Callable[[list[int], int], tuple[list[int], float]]


def engine_name(drafter: str, tree: str | None) -> str:
    return drafter if tree in (None, "chain") or drafter == "plain" else f"{drafter}@{tree}"


def run_bench(gen: Generator, prompts: Sequence[Prompt], drafters: Sequence[str], max_new_tokens: int,
              repeats: int = 1, peers: dict[str, Peer] | None = None, raw: bool = False,
              progress: bool = True, trees: Sequence[str | None] = (None,),
              sampling: SamplingParams | None = None) -> dict:
    """Every (drafter, tree) and peer on every prompt, interleaved. With sampling, each run uses the
    same seed; `identical_to_plain` is then reported only for greedy runs."""
    peers = peers or {}
    sampling = sampling or SamplingParams()
    engines = {"plain": ("plain", None)}  # plain is the reference for every ratio
    for d in drafters:
        for t in trees:
            engines.setdefault(engine_name(d, t), (d, t))
    for d, t in engines.values():
        gen.use(d, t)
    encoded = {p.id: gen.tokenizer.encode_prompt(p.prompt, raw) for p in prompts}
    # warm-up: every engine once on the first prompt
    first = encoded[prompts[0].id]
    for d, t in engines.values():
        gen.use(d, t).generate_ids(first, min(16, max_new_tokens), sampling)
    for run in peers.values():
        run(first, min(16, max_new_tokens))

    rows, outputs = [], {}
    total = repeats * len(prompts) * (len(engines) + len(peers))
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for rep in range(repeats):
            for p in prompts:
                for name, (d, t) in engines.items():
                    res = gen.use(d, t).generate_ids(encoded[p.id], max_new_tokens, sampling)
                    st = res.stats
                    rows.append({"drafter": name, "id": p.id, "category": p.category, "repeat": rep,
                                 "new_tokens": st.new_tokens, "seconds": round(st.seconds, 4),
                                 "tokens_per_s": round(st.tokens_per_s, 3),
                                 "mean_accepted_len": round(st.mean_accepted_len, 4),
                                 "acceptance_rate": round(st.acceptance_rate, 4), "steps": st.steps,
                                 "accepted_per_position": st.accepted_per_position,
                                 "stage_seconds": {k: round(v, 4) for k, v in st.stage_seconds.items()}})
                    outputs[(name, p.id, rep)] = res.token_ids
                    bar.update()
                for name, run in peers.items():
                    ids, seconds = run(encoded[p.id], max_new_tokens)
                    rows.append({"drafter": name, "id": p.id, "category": p.category, "repeat": rep,
                                 "new_tokens": len(ids), "seconds": round(seconds, 4),
                                 "tokens_per_s": round(len(ids) / seconds, 3) if seconds else 0.0,
                                 "mean_accepted_len": None, "acceptance_rate": None})
                    outputs[(name, p.id, rep)] = ids
                    bar.update()
    for r in rows:
        same = outputs[(r["drafter"], r["id"], r["repeat"])] == outputs[("plain", r["id"], r["repeat"])]
        r["identical_to_plain"] = same if sampling.greedy else None
    return {"config": {"engines": list(engines), "peers": list(peers), "max_new_tokens": max_new_tokens,
                       "repeats": repeats, "threads": gen.threads, "num_draft_tokens": gen.k,
                       "trees": [t or "chain" for t in trees], "temperature": sampling.temperature,
                       "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
                       "prompts": len(prompts)},
            "rows": rows, "summary": summarize(rows), "by_category": summarize(rows, by_category=True)}


def _median_tps(rows: list[dict]) -> dict[tuple, float]:
    per = defaultdict(list)
    for r in rows:
        per[(r["drafter"], r["id"])].append(r["tokens_per_s"])
    return {k: statistics.median(v) for k, v in per.items()}


def summarize(rows: list[dict], by_category: bool = False) -> dict:
    """Per drafter (or per drafter and category): median tokens/s, speedup vs plain, τ, identical k/n."""
    tps = _median_tps(rows)
    groups = defaultdict(list)
    for r in rows:
        groups[(r["drafter"], r["category"]) if by_category else r["drafter"]].append(r)
    out = {}
    for key, rs in groups.items():
        ids = sorted({r["id"] for r in rs})
        name = key[0] if by_category else key
        ratios = [tps[(name, i)] / tps[("plain", i)] for i in ids if tps.get(("plain", i))]
        taus = [r["mean_accepted_len"] for r in rs if r["mean_accepted_len"] is not None]
        steps = sum(r.get("steps") or 0 for r in rs)
        depth = max((len(r.get("accepted_per_position") or []) for r in rs), default=0)
        per_pos = [sum(((r.get("accepted_per_position") or [])[d:d + 1] or [0])[0] for r in rs) for d in range(depth)]
        entry = {"tokens_per_s_median": round(statistics.median(tps[(name, i)] for i in ids), 2),
                 "speedup_vs_plain": round(statistics.median(ratios), 3) if ratios else None,
                 "mean_accepted_len": round(statistics.fmean(taus), 3) if taus else None,
                 # share of verify steps that accepted a draft at depth 1, 2, ... (τ = 1 + their sum)
                 "acceptance_by_position": [round(c / steps, 3) for c in per_pos] if steps else [],
                 "identical": (f"{sum(bool(r['identical_to_plain']) for r in rs)}/{len(rs)}"
                               if all(r["identical_to_plain"] is not None for r in rs) else "n/a (sampling)")}
        out["/".join(key) if by_category else key] = entry
    return out


def format_table(summary: dict) -> str:
    lines = [f"{'engine':<28} {'tok/s (median)':>15} {'× plain':>9} {'τ':>7} {'identical':>16}  accepted at depth 1,2,3,…"]
    for name, s in summary.items():
        sp = f"{s['speedup_vs_plain']:.2f}" if s["speedup_vs_plain"] is not None else "-"
        tau = f"{s['mean_accepted_len']:.2f}" if s["mean_accepted_len"] is not None else "-"
        pos = " ".join(f"{a:.2f}" for a in s.get("acceptance_by_position", [])[:6])
        lines.append(f"{name:<28} {s['tokens_per_s_median']:>15.1f} {sp:>9} {tau:>7} {s['identical']:>16}  {pos}")
    return "\n".join(lines)
