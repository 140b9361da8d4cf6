"""Batch invariance of a target graph, measured on the machine that runs it.

Speculative greedy output equals plain greedy output only if a verify pass computes, bit for bit,
the rows plain decoding computes one pass at a time. Each check below compares the two ways on
random tokens, under an execution mode (runtime/exec_modes.py), and reports max |Δlogits|:

    chain   prefill 260 tokens, then a window of k (2..17)     vs  plain: one pass per token
    tree    a window with branches                              vs  plain along each root-to-leaf path
    batch   one ragged pass over 3 KV slots, each at its own    vs  each slot decoded alone
            past_len, windows padded to the longest (serving;
            one row each where the backend batches no windows)
    kv      the pass after each window, reading the KV rows     vs  the same pass after plain decoding
            the window wrote

A mode is invariant when every check is exactly 0.0. `choose` measures `direct` and then the
padded modes, cheapest first, and returns every measurement plus the first invariant mode. The batch
check's kv part is also kept alone (`batch_kv`): a mode whose batch and batch_kv checks are 0 batches
plain decoding exactly even where its windows are not (`plain_batches`).
"""

from __future__ import annotations

import time

import numpy as np

from specrt.runtime.exec_modes import MODES, ExecMode, shaped
from specrt.runtime.sequence import Pass, pack_windows
from specrt.runtime.tree import Tree

CHAINS = (2, 3, 5, 9, 17)
TREE = Tree.from_parents([-1, 0, 0, 1, 1, 2, 4])  # two branches under the root, three leaves
BATCH = ((5, 1), (9, 3), (12, 2))  # (prompt tokens, window tokens) per KV slot in the ragged pass
PROMPT = 12
LONG_PROMPT = 260  # the chain check's prefix crosses the 128/256-column blocks of attention kernels
ROWS = LONG_PROMPT + max(CHAINS) + 2  # KV rows per slot the checks use
CHECKS = ("chain", "tree", "batch", "kv")
SPECULATION = ("chain", "tree", "chain_kv")  # what drafted windows at batch 1 need
BATCHES = ("batch", "batch_kv")  # what batched plain decoding needs


class _Probe:
    """Batch-1 and ragged passes over one decoder, as the runtime shapes them."""

    def __init__(self, decoder):
        self.dec = decoder

    def one(self, slot: int, tokens, past: int, tree: Tree | None = None, rows=None) -> np.ndarray:
        tree = tree or Tree.chain(len(tokens) - 1)
        rows = np.arange(tree.size) if rows is None else np.asarray(rows)
        return self.ragged([Pass(np.asarray(tokens, np.int64), past, tree, rows)], slot)[0, : len(rows)]

    def ragged(self, plans: list[Pass], lo: int = 0) -> np.ndarray:
        self.dec.select(lo, lo + len(plans))
        return self.dec.run_all(*pack_windows(plans))["logits"]

    def prefill(self, slot: int, prompt) -> np.ndarray:
        return self.one(slot, prompt, 0, rows=[len(prompt) - 1])[0]

    def plain(self, slot: int, past: int, cont) -> np.ndarray:
        """Logits plain decoding computes for each token of `cont` after the `past` rows already in the
        slot's KV (one pass each). Passes only write rows ≥ past, so a prefix is prefilled once."""
        return np.stack([self.one(slot, [tok], past + i)[0] for i, tok in enumerate(cont)])


def _diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def _chain(p: _Probe, rng, vocab: int) -> tuple[float, float]:
    prompt = rng.integers(0, vocab, LONG_PROMPT)
    cont = rng.integers(0, vocab, max(CHAINS) + 1)
    p.prefill(0, prompt)
    want = p.plain(0, LONG_PROMPT, cont)  # want[i]: logits after prompt + cont[:i+1]
    worst = kv = 0.0
    for k in CHAINS:
        worst = max(worst, _diff(p.one(0, cont[:k], LONG_PROMPT), want[:k]))
        kv = max(kv, _diff(p.one(0, cont[k : k + 1], LONG_PROMPT + k)[0], want[k]))
    return worst, kv


def _tree(p: _Probe, rng, vocab: int) -> float:
    prompt = rng.integers(0, vocab, PROMPT)
    tokens = rng.integers(0, vocab, TREE.size)
    p.prefill(0, prompt)
    got = p.one(0, tokens, PROMPT, TREE)
    parents = TREE.parents
    worst = 0.0
    for leaf in sorted(set(range(TREE.size)) - set(parents)):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        worst = max(worst, _diff(got[path], p.plain(0, PROMPT, tokens[path])))
    return worst


def _batch(p: _Probe, rng, vocab: int, windows: bool = True) -> tuple[float, float]:
    batch = BATCH if windows else tuple((n, 1) for n, _ in BATCH)
    prompts = [rng.integers(0, vocab, n) for n, _ in batch]
    conts = [rng.integers(0, vocab, m + 1) for _, m in batch]
    for s, pr in enumerate(prompts):  # admission: each prompt prefilled alone in its slot
        p.prefill(s, pr)
    want = [p.plain(s, len(pr), c) for s, (pr, c) in enumerate(zip(prompts, conts, strict=True))]
    plans = [Pass(c[:m], len(pr), Tree.chain(m - 1), np.arange(m)) for pr, c, (_, m) in zip(prompts, conts, batch,
                                                                                              strict=True)]
    got = p.ragged(plans)
    worst = max(_diff(got[s, :m], want[s][:m]) for s, (_, m) in enumerate(batch))
    nxt = [Pass(c[m : m + 1], len(pr) + m, Tree.chain(0), np.arange(1))
           for pr, c, (_, m) in zip(prompts, conts, batch, strict=True)]
    got = p.ragged(nxt)
    kv = max(_diff(got[s, 0], want[s][m]) for s, (_, m) in enumerate(batch))
    return worst, kv


def measure(decoder, vocab: int, mode: ExecMode, seed: int = 0, trees: bool = True,
            batch_windows: bool = True) -> dict:
    """Max |Δlogits| of every check under `mode` on `decoder` (KV rows ≥ ROWS per slot; the batch
    check needs 3 slots and is None on a batch-1 decoder; the tree check is None for a backend that
    verifies chains only, `trees=False`; `batch_windows=False`: the backend batches one row per
    sequence, and so does the batch check). A check the backend refuses to run in this mode (a padded
    batch it cannot take) counts as not invariant (inf)."""
    p = _Probe(shaped(decoder, mode))
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    chain, kv = _chain(p, rng, vocab)
    out = {"chain": chain, "tree": _tree(p, rng, vocab) if trees else None, "batch": None, "kv": kv,
           "chain_kv": kv, "batch_kv": None}
    if decoder.batch >= len(BATCH):
        try:
            out["batch"], batch_kv = _batch(p, rng, vocab, batch_windows)
        except Exception:  # noqa: BLE001 — the backend's own refusal of this shape, whatever its type
            out["batch"] = batch_kv = float("inf")
        out["kv"], out["batch_kv"] = max(kv, batch_kv), batch_kv
    out["invariant"] = all(out[c] in (None, 0.0) for c in CHECKS)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def exact_for(measurement: dict, checks: tuple[str, ...]) -> bool:
    """Are `checks` of one mode's measurement all 0.0 (a check not made, None, counts as passed)?"""
    return all(measurement.get(c) in (None, 0.0) for c in checks)


def plain_batches(measurement: dict) -> bool:
    """Does the mode batch plain decoding exactly (its batch checks made, and 0.0)?"""
    return measurement.get("batch") is not None and exact_for(measurement, BATCHES)


def choose(decoder, vocab: int, modes: list[ExecMode] | None = None, seed: int = 0,
           trees: bool = True, batch_windows: bool = True) -> tuple[str | None, dict]:
    """(the first invariant mode, or None; each measured mode's checks). Modes are tried in order
    (default: cheapest first) until one is invariant."""
    measured = {}
    for mode in modes or list(MODES.values()):
        measured[mode.name] = measure(decoder, vocab, mode, seed, trees, batch_windows)
        if measured[mode.name]["invariant"]:
            return mode.name, measured
    return None, measured
