"""Side-by-side benchmark: every drafter (and optional peers) on the same prompts, interleaved.

Ratios are measured in one process after a warm-up; `speedup_vs_plain` is the median over prompts
of (drafter tokens/s ÷ plain tokens/s), each prompt's tokens/s being the median over repeats;
`speedup_vs[peer]` is the same ratio against each peer engine (`specrt bench --peers`).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator
from specrt.runtime.payoff import AUTO
from specrt.runtime.reference import same_reference
from specrt.runtime.sampling import SamplingParams
from specrt.tools.peer_types import Peer  # noqa: F401  (re-exported: bench callers build Peers)


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


ADAPTIVE = "+adaptive"  # `--drafters eagle3+adaptive`: that drafter with adaptive draft depth


def config_name(drafter: str, tree: str | None) -> str:
    return drafter if tree in (None, "chain") or drafter == "plain" else f"{drafter}@{tree}"


def config_spec(drafter: str) -> tuple[str, bool | None]:
    """(runtime drafter, adaptive) of a bench drafter name: "ngram+adaptive" -> ("ngram", True);
    None leaves the generator's setting."""
    if drafter.endswith(ADAPTIVE):
        return drafter[: -len(ADAPTIVE)], True
    return drafter, None


def run_bench(gen: Generator, prompts: Sequence[Prompt], drafters: Sequence[str], max_new_tokens: int,
              repeats: int = 1, peers: dict[str, Peer] | None = None, raw: bool = False,
              progress: bool = True, trees: Sequence[str | None] = (None,),
              sampling: SamplingParams | None = None, cooldown: float = 0.1) -> dict:
    """Every (drafter, tree) and peer on every prompt, interleaved. With sampling, each run uses the
    same seed; `identical_to_plain` is then reported only for greedy runs. Before each timed run the
    process idles `cooldown` seconds (not timed) so the previous engine's spinning worker threads
    (ONNX Runtime's, OpenMP's in llama.cpp and torch) have gone to sleep and do not steal its cores.
    Each engine has drafter instances of its own: a drafter that remembers earlier sequences (suffix) drafts
    only from the prompts this engine ran before in the same repeat, never from another engine's answer
    to the same prompt, the warm-up or an earlier repeat."""
    peers = {n: p if isinstance(p, Peer) else Peer(p) for n, p in (peers or {}).items()}
    sampling = sampling or SamplingParams()
    configs = {"plain": ("plain", None, None)}  # plain is the reference for every ratio
    for d in drafters:
        for t in trees:
            configs.setdefault(config_name(d, t), (*config_spec(d), t))
    for name, peer in peers.items():
        if name in configs:
            raise SpecrtError(f"peer {name!r} has the name of a specrt configuration")
        if peer.reference is not None and peer.reference not in configs and peer.reference not in peers:
            raise SpecrtError(f"peer {name!r} is checked against {peer.reference!r}, "
                              "which is not in this run")
    for name, (d, a, t) in configs.items():
        gen.use(d, t, a, scope=name)
    encoded = {p.id: gen.tokenizer.encode_prompt(p.prompt, raw) for p in prompts}
    # warm-up: every engine once on the first prompt
    first = encoded[prompts[0].id]
    for name, (d, a, t) in configs.items():
        gen.use(d, t, a, scope=name).generate_ids(first, min(16, max_new_tokens), sampling)
    for peer in peers.values():
        peer.run(first, min(16, max_new_tokens))

    rows, outputs = [], {}
    total = repeats * len(prompts) * (len(configs) + len(peers))
    with tqdm(total=total, desc="bench", unit="run", disable=not progress) as bar:
        for rep in range(repeats):
            gen.forget()  # each repeat starts with no stored sequence: none of its prompts seen (warm-up included)
            for p in prompts:
                for name, (d, a, t) in configs.items():
                    time.sleep(cooldown)
                    res = gen.use(d, t, a, scope=name).generate_ids(encoded[p.id], max_new_tokens, sampling)
                    st = res.stats
                    rows.append({"drafter": name, "id": p.id, "category": p.category, "repeat": rep,
                                 "peer": False, "reference": "plain", "new_tokens": st.new_tokens,
                                 "seconds": round(st.seconds, 4),
                                 "tokens_per_s": round(st.tokens_per_s, 3),
                                 "mean_accepted_len": round(st.mean_accepted_len, 4),
                                 "acceptance_rate": round(st.acceptance_rate, 4), "steps": st.steps,
                                 "accepted_per_position": st.accepted_per_position,
                                 "plain_steps": st.plain_steps, "mean_draft_depth": round(st.mean_draft_depth, 3),
                                 "stage_seconds": {k: round(v, 4) for k, v in st.stage_seconds.items()},
                                 "drafter_used": res.drafter})
                    if d == AUTO:  # which drafter this request chose, why, and the pay-offs it compared
                        rows[-1]["auto"] = gen.last_pick.to_dict()
                    outputs[(name, p.id, rep)] = res.token_ids
                    bar.update()
                for name, peer in peers.items():
                    time.sleep(cooldown)
                    ids, seconds = peer.run(encoded[p.id], max_new_tokens)
                    rows.append({"drafter": name, "id": p.id, "category": p.category, "repeat": rep,
                                 "peer": True, "reference": peer.reference, "new_tokens": len(ids),
                                 "seconds": round(seconds, 4),
                                 "tokens_per_s": round(len(ids) / seconds, 3) if seconds else 0.0,
                                 "mean_accepted_len": None, "acceptance_rate": None})
                    outputs[(name, p.id, rep)] = ids
                    bar.update()
    for r in rows:  # identity with the row's reference engine (peers: their own engine's plain run)
        out = outputs[(r["drafter"], r["id"], r["repeat"])]
        ref = r["reference"]
        r["identical_to_plain"] = (out == outputs[(ref, r["id"], r["repeat"])]
                                   if sampling.greedy and ref is not None else None)
        if r["peer"]:  # peers decode greedily whatever --temperature says
            specrt_plain = outputs[("plain", r["id"], r["repeat"])]
            r["same_as_specrt_plain"] = out == specrt_plain if sampling.greedy else None
    # what each reference engine is (runtime/reference.py): specrt's plain here; a specrt peer's plain (another
    # backend, mode or bundle) says so in its settings; other engines' plain runs are references of their own
    references = {"plain": gen.reference.to_dict(sampling.greedy)}
    references.update({n: p.settings.get("exact_to") for n, p in peers.items() if p.reference is None})
    return {"config": {"configs": list(configs), "peers": list(peers), "references": references,
                       "peer_settings": {n: {"reference": p.reference, **p.settings}
                                         for n, p in peers.items()},
                       "max_new_tokens": max_new_tokens,
                       "repeats": repeats, "threads": gen.threads, "num_draft_tokens": gen.k,
                       "trees": [t or "chain" for t in trees], "temperature": sampling.temperature,
                       "top_k": sampling.top_k, "top_p": sampling.top_p, "seed": sampling.seed,
                       "prompts": len(prompts)},
            "rows": rows, "summary": summarize(rows, references=references),
            "by_category": summarize(rows, by_category=True, references=references)}


def _median_tps(rows: list[dict]) -> dict[tuple, float]:
    per = defaultdict(list)
    for r in rows:
        per[(r["drafter"], r["id"])].append(r["tokens_per_s"])
    return {k: statistics.median(v) for k, v in per.items()}


def _ratio(tps: dict, name: str, other: str, ids: list[str]) -> float | None:
    ratios = [tps[(name, i)] / tps[(other, i)] for i in ids if tps.get((other, i)) and (name, i) in tps]
    return round(statistics.median(ratios), 3) if ratios else None


def _identical(rs: list[dict]) -> str:
    if all(r.get("peer") and r.get("reference") is None for r in rs):
        return "reference"  # a plain peer: the engine its speculative variants are checked against
    if all(r["identical_to_plain"] is not None for r in rs):
        return f"{sum(bool(r['identical_to_plain']) for r in rs)}/{len(rs)}"
    return "n/a (sampling)"


def summarize(rows: list[dict], by_category: bool = False, references: dict | None = None) -> dict:
    """Per drafter (or per drafter and category): tokens/s (median, min and max over prompts, each
    prompt's value the median over repeats), speedup vs plain and vs every peer, τ, identical k/n
    (against the row's reference engine, `held_to`: plain for specrt, the peer's own plain run for a peer;
    `held_to_is` says what that engine is where `references` (engine -> runtime/reference.py record) knows).
    A peer held to another specrt reference than plain (another backend, mode or bundle) compares its
    plain output with specrt's as one reference with another: `same_as_specrt_plain` is then
    "different reference (d/n differ)" where d of n prompts differ, not a failure."""
    tps = _median_tps(rows)
    peers = list(dict.fromkeys(r["drafter"] for r in rows if r.get("peer")))
    groups = defaultdict(list)
    for r in rows:
        groups[(r["drafter"], r["category"]) if by_category else r["drafter"]].append(r)
    out = {}
    for key, rs in groups.items():
        ids = sorted({r["id"] for r in rs})
        name = key[0] if by_category else key
        per_prompt = [tps[(name, i)] for i in ids]
        taus = [r["mean_accepted_len"] for r in rs if r["mean_accepted_len"] is not None]
        steps = sum(r.get("steps") or 0 for r in rs)
        depth = max((len(r.get("accepted_per_position") or []) for r in rs), default=0)
        per_pos = [sum(((r.get("accepted_per_position") or [])[d:d + 1] or [0])[0] for r in rs) for d in range(depth)]
        entry = {"tokens_per_s_median": round(statistics.median(per_prompt), 2),
                 "tokens_per_s_min": round(min(per_prompt), 2), "tokens_per_s_max": round(max(per_prompt), 2),
                 "speedup_vs_plain": _ratio(tps, name, "plain", ids),
                 "speedup_vs": {p: _ratio(tps, name, p, ids) for p in peers if p != name},
                 "mean_accepted_len": round(statistics.fmean(taus), 3) if taus else None,
                 # share of verify steps that accepted a draft at depth 1, 2, ... (τ = 1 + their sum)
                 "acceptance_by_position": [round(c / steps, 3) for c in per_pos] if steps else [],
                 "identical": _identical(rs)}
        if any("auto" in r for r in rs):  # --drafter auto: requests per drafter it chose
            used = defaultdict(int)
            for r in rs:
                used[r["drafter_used"]] += 1
            entry["drafters_used"] = dict(sorted(used.items(), key=lambda kv: -kv[1]))
        held_to = rs[0].get("reference") or name  # a plain peer is held to itself
        entry["held_to"] = held_to
        known = (references or {}).get(held_to)
        if known:
            entry["held_to_is"] = known["text"]
        if any(r.get("peer") for r in rs):
            entry["reference"] = rs[0].get("reference")
            entry.update(_same_as_plain(rs, same_reference(known, (references or {}).get("plain"))))
        out["/".join(key) if by_category else key] = entry
    return out


def _same_as_plain(rs: list[dict], same_ref: bool | None) -> dict:
    """`same_as_specrt_plain` of a peer's rows: k/n runs equal to specrt's plain output; for a peer held to
    a different specrt reference (same_ref False), "different reference (d/n differ)" over prompts."""
    same = [r.get("same_as_specrt_plain") for r in rs]
    if any(v is None for v in same):
        return {"same_as_specrt_plain": "n/a (sampling)"}
    if same_ref is False:
        ids = sorted({r["id"] for r in rs})
        differ = sorted({r["id"] for r in rs if not r["same_as_specrt_plain"]})
        label = f"different reference ({len(differ)}/{len(ids)} differ)" if differ else f"{len(ids)}/{len(ids)}"
        return {"same_as_specrt_plain": label, "different_reference": True, "prompts_differing": len(differ)}
    return {"same_as_specrt_plain": f"{sum(map(bool, same))}/{len(same)}"}


def format_table(summary: dict) -> str:
    """One line per engine; one `× PEER` column per peer present (its tok/s ÷ that peer's); `held to`: the
    engine its `identical` column is checked against; below, what each such reference engine is."""
    peers = list(dict.fromkeys(p for s in summary.values() for p in s.get("speedup_vs", {})))
    held = max([len("held to"), *(len(s.get("held_to", "")) for s in summary.values())])
    lines = [f"{'engine':<34} {'tok/s (median)':>15} {'min–max':>13} {'× plain':>9}"
             + "".join(f" {'× ' + p:>{max(9, len(p) + 2)}}" for p in peers)
             + f" {'τ':>7} {'identical':>16} {'held to':<{held}} {'= specrt plain':>14}  accepted at depth 1,2,3,…"]
    for name, s in summary.items():
        sp = f"{s['speedup_vs_plain']:.2f}" if s["speedup_vs_plain"] is not None else "-"
        vs = "".join(f" {_fmt(s.get('speedup_vs', {}).get(p)):>{max(9, len(p) + 2)}}" for p in peers)
        tau = f"{s['mean_accepted_len']:.2f}" if s["mean_accepted_len"] is not None else "-"
        pos = " ".join(f"{a:.2f}" for a in s.get("acceptance_by_position", [])[:6])
        lo, hi = s.get("tokens_per_s_min"), s.get("tokens_per_s_max")
        spread = f"{lo:.0f}–{hi:.0f}" if lo is not None and hi is not None else "-"
        same = s.get("same_as_specrt_plain", "")
        lines.append(f"{name:<34} {s['tokens_per_s_median']:>15.1f} {spread:>13} {sp:>9}{vs} {tau:>7} "
                     f"{s['identical']:>16} {s.get('held_to', ''):<{held}} {same:>14}  {pos}")
    lines += [f"{name}: requests ran " + ", ".join(f"{d} {n}" for d, n in s["drafters_used"].items())
              for name, s in summary.items() if "drafters_used" in s]
    refs = {s["held_to"]: s["held_to_is"] for s in summary.values() if s.get("held_to_is")}
    lines += [f"reference {name} = {text}" for name, text in refs.items()]
    lines += [f"{name} is a different reference from plain: its plain output differs from plain's on "
              f"{s['prompts_differing']} prompt(s); each engine is exact to its own reference"
              for name, s in summary.items() if s.get("different_reference") and s.get("prompts_differing")
              and name == s.get("held_to")]  # a plain peer's own line (not its per-category ones)
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return f"{x:.2f}" if x is not None else "-"
