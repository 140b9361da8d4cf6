"""`specrt tune`: pick drafter, tree shape and draft depth by measured throughput on the user's prompts.

Every candidate runs every prompt greedily after a warm-up, interleaved with plain decoding so the
ratios are measured side by side; a candidate whose output differs from plain on any prompt is
disqualified (it never should: that would be a bug to report). The winner — highest median
speedup over plain — is written into the bundle's manifest as `runtime_defaults`, which `specrt
generate` / `specrt-run` use when no drafter is named.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from tqdm import tqdm

from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator
from specrt.schema.manifest import Manifest


@dataclass(frozen=True)
class Candidate:
    drafter: str
    num_draft_tokens: int = 5
    tree: str | None = None
    adaptive: bool = False
    tree_nodes: int | None = None
    beam: int | None = None
    fan: int | None = None

    @property
    def label(self) -> str:
        parts = [self.drafter]
        if self.drafter != "plain":
            parts.append(f"tree={self.tree}" if self.tree not in (None, "chain") else f"k={self.num_draft_tokens}")
        if self.tree_nodes:
            parts.append(f"nodes={self.tree_nodes}")
        if self.beam:
            parts.append(f"beam={self.beam}")
        if self.fan:
            parts.append(f"fan={self.fan}")
        if self.adaptive:
            parts.append("adaptive")
        return " ".join(parts)

    def settings(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


# Shapes run from one drafted row up: on a CPU a verify pass of 4 rows costs 1.4-1.6x one row and of 11 rows
# about 2.5x (docs/performance.md), so the shortest drafts are often the fastest; a machine with a flatter
# cost curve picks the wider ones.
def _chain(d: str) -> list[Candidate]:
    return [Candidate(d, k) for k in (1, 2, 3, 4, 6)] + [Candidate(d, 6, adaptive=True)]


def _stored_tree(d: str) -> list[Candidate]:  # medusa: its exported tree, or chains
    return [Candidate(d)] + [Candidate(d, k, tree="chain") for k in (2, 3)] + [Candidate(d, 4, adaptive=True)]


def _dynamic(d: str) -> list[Candidate]:  # EAGLE-2 style: node budget per step, from a chain of one row up
    chains = [Candidate(d, k, tree_nodes=k, beam=1) for k in (1, 2, 3)]
    fans = [Candidate(d, k, fan=w) for w, k in ((2, 1), (3, 1), (2, 2))]  # the first step's best side by side
    return chains + fans + [Candidate(d, 3, tree_nodes=4, beam=2)] + [Candidate(d, 5, tree_nodes=n) for n in (6, 10)] + \
        [Candidate(d, 5, tree_nodes=6, adaptive=True)]


def _chain_or_tree(d: str) -> list[Candidate]:  # suffix: chains, or a tree shape's limits for its own tree
    return _chain(d) + [Candidate(d, tree=t) for t in ("binary", "default", "wide")]


# search spaces by name; each kind's spec (specrt/kinds/) says which one its runtime drafters use
SPACES: dict[str, Callable[[str], list[Candidate]]] = {"chain": _chain, "stored_tree": _stored_tree,
                                                       "dynamic": _dynamic, "chain_or_tree": _chain_or_tree}


def search_space(drafter: str) -> Callable[[str], list[Candidate]]:
    from specrt.kinds import runtime_drafters

    spaces = {d: s.search[d] for d, s in runtime_drafters().items() if d in s.search}
    if drafter not in spaces:
        raise SpecrtError(f"tune does not know drafter {drafter!r}: choose from {', '.join(sorted(spaces))}")
    return SPACES[spaces[drafter]]


def candidates(drafters: Sequence[str]) -> list[Candidate]:
    out = []
    for d in drafters:
        if d == "plain":
            continue
        out += search_space(d)(d)
    return out


def _run(gen: Generator, c: Candidate, prompts: list[list[int]], max_new_tokens: int) -> list:
    gen.configure(c.num_draft_tokens, c.tree, c.adaptive, tree_nodes=c.tree_nodes, beam=c.beam, fan=c.fan)
    gen.use(c.drafter).generate_ids(prompts[0], min(16, max_new_tokens))  # warm-up
    return [gen.generate_ids(p, max_new_tokens) for p in prompts]


def tune(gen: Generator, prompts: list[list[int]], drafters: Sequence[str], max_new_tokens: int = 96,
         progress: bool = True) -> dict:
    """Measure every candidate against plain (re-measured beside each candidate); returns the table and
    the winning candidate's settings."""
    plain = Candidate("plain")
    rows = []
    for c in tqdm(candidates(drafters), desc="tune", unit="config", disable=not progress):
        base = _run(gen, plain, prompts, max_new_tokens)
        res = _run(gen, c, prompts, max_new_tokens)
        ratios = [r.stats.tokens_per_s / b.stats.tokens_per_s for r, b in zip(res, base, strict=True)]
        rows.append({"label": c.label, "settings": c.settings(),
                     "tokens_per_s": round(statistics.median(r.stats.tokens_per_s for r in res), 2),
                     "plain_tokens_per_s": round(statistics.median(b.stats.tokens_per_s for b in base), 2),
                     "speedup_vs_plain": round(statistics.median(ratios), 3),
                     "mean_accepted_len": round(statistics.fmean(r.stats.mean_accepted_len for r in res), 3),
                     "identical": all(r.token_ids == b.token_ids for r, b in zip(res, base, strict=True))})
    valid = [r for r in rows if r["identical"]]
    if not valid:
        raise SpecrtError("no candidate reproduced plain greedy output; please report this bundle")
    best = max(valid, key=lambda r: r["speedup_vs_plain"])
    if best["speedup_vs_plain"] <= 1.0:
        best = {"label": "plain", "settings": plain.settings(), "speedup_vs_plain": 1.0}
    return {"rows": rows, "best": best}


def save_choice(bundle, result: dict, prompts: int, max_new_tokens: int, threads: int) -> Manifest:
    manifest = Manifest.load(bundle)
    best = result["best"]
    manifest.runtime_defaults = {**best["settings"],
                                 "tuned": {"speedup_vs_plain": best["speedup_vs_plain"], "prompts": prompts,
                                           "max_new_tokens": max_new_tokens, "threads": threads}}
    manifest.save(bundle)
    return manifest
