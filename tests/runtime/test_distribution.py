"""Speculative sampling follows the target distribution exactly — and wrong rules are caught.

Toy exact models over a vocabulary of 6: target and draft are second-order Markov chains given by
random logit tables, so the exact distribution of the next 3 tokens is computable (216 outcomes).
Speculative sampling runs the production acceptance rule (the specrt::RejectionSample ONNX op
through ONNX Runtime) on chain and tree drafts, one-hot (top-r of the draft) and stochastic (i.i.d.
draws from the draft) proposals, with and without temperature/top-k/top-p. Pearson's chi-square at
α = 1e-3 must pass for the real rule and fail for each deliberately wrong rule.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from specrt.plugins.rejection_sample import children, normalize, sample_from
from specrt.runtime.acceptance import Window, one_hot_rows, rejection
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.tree import Tree
from specrt.tools.lossless import chi_square

V, L = 6, 3
_tables = np.random.default_rng(1234)
TARGET = (1.5 * _tables.normal(size=(V, V, V))).astype(np.float32)
DRAFT = (TARGET + 1.5 * _tables.normal(size=(V, V, V))).astype(np.float32)
PROMPT = (0, 1)
SAMPLES = 6000

CHAIN = Tree.chain(3)
TREE = Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
PARAMS = {"t1": SamplingParams(temperature=1.0),
          "t0.7-k4-p0.9": SamplingParams(temperature=0.7, top_k=4, top_p=0.9)}


def exact_distribution(params: SamplingParams) -> dict[tuple, float]:
    out = {}
    for seq in itertools.product(range(V), repeat=L):
        ctx, prob = list(PROMPT), 1.0
        for tok in seq:
            prob *= float(warp(TARGET[ctx[-2], ctx[-1]], params)[tok])
            ctx.append(tok)
        out[seq] = prob
    return out


@functools.cache
def draft_dist(a: int, b: int, params: SamplingParams) -> np.ndarray:
    """The draft's warped next-token distribution after (a, b): 36 contexts, computed once each (read-only)."""
    dist = warp(DRAFT[a, b], params)
    dist.flags.writeable = False
    return dist


def propose(ctx: list[int], shape: Tree, max_depth: int, stochastic: bool, params, rng):
    """Window tokens, tree and draft rows for `shape` (cut at max_depth), as the draft drafter does."""
    keep = [i for i in range(1, shape.size) if shape.depth[i] <= max_depth]
    tokens, q = {0: ctx[-1]}, {}
    hist = {0: list(ctx)}
    for i in keep:
        p = shape.parents[i]
        dist = draft_dist(hist[p][-2], hist[p][-1], params)
        if stochastic:
            tokens[i], q[i] = sample_from(dist, float(rng.random())), dist
        else:
            tokens[i] = int(np.argsort(-dist, kind="stable")[shape.ranks[i]])
        hist[i] = hist[p] + [tokens[i]]
    slot = {0: 0, **{i: j + 1 for j, i in enumerate(keep)}}
    tree = Tree.from_parents([-1] + [slot[shape.parents[i]] for i in keep])
    window = np.array([tokens[0]] + [tokens[i] for i in keep])
    rows = np.stack([np.zeros(V, np.float32)] + [q[i] for i in keep]) if stochastic else None
    logits = np.stack([TARGET[hist[i][-2], hist[i][-1]] for i in [0, *keep]])
    return window, tree, rows, logits


def speculative_sequences(rule, shape: Tree, stochastic: bool, params, seed: int, n: int = SAMPLES):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):
        ctx, out = list(PROMPT), []
        while len(out) < L:
            window, tree, q, logits = propose(ctx, shape, L - len(out) - 1, stochastic, params, rng)
            path, nxt = rule(Window(window, tree, q), logits, params, rng)
            new = [*window[path].tolist(), nxt]
            out += new
            ctx += new
        seqs.append(tuple(out[:L]))
    return seqs


CONFIGS = [(shape_name, stochastic, pname) for shape_name in ("chain", "tree") for stochastic in (False, True)
           for pname in PARAMS]


@pytest.mark.parametrize("shape_name,stochastic,pname", CONFIGS)
def test_rejection_sampling_follows_the_target(shape_name, stochastic, pname):
    shape = CHAIN if shape_name == "chain" else TREE
    params = PARAMS[pname]
    result = chi_square(speculative_sequences(rejection, shape, stochastic, params, seed=len(pname) + stochastic),
                        exact_distribution(params))
    assert result.verdict == "pass", result.to_dict()


def test_the_toy_setup_has_power():
    """Sanity: plain draft sampling (always accept the draft) is far from the target."""
    params = PARAMS["t1"]

    def accept_all(w, logits, params, rng):
        return [c for c in range(1, len(w.tokens)) if w.tree.parents[c] == c - 1], sample_from(
            warp(logits[-1], params), float(rng.random()))

    result = chi_square(speculative_sequences(accept_all, CHAIN, True, params, seed=5, n=2000),
                        exact_distribution(params))
    assert result.verdict == "fail", result.to_dict()


# ── deliberately wrong rules: each must be caught ──────────────────────────────────────────────
def mutant(*, renormalize=True, use_residual=True, update_between_siblings=True, use_q=True):
    """The sequential rejection rule with one of its parts broken."""

    def rule(w: Window, logits, params, rng):
        p_rows = warp(logits, params)
        q_rows = w.draft_probs if w.draft_probs is not None else one_hot_rows(w.tokens, logits.shape[-1])
        u = rng.random(len(w.tokens), dtype=np.float32)
        node, path = 0, []
        while True:
            p = p_rows[node].copy()
            for c in children(w.tree.parents, node):
                x, q = int(w.tokens[c]), q_rows[c]
                if u[c] * (q[x] if use_q else 1.0) < p[x]:
                    path.append(c)
                    node = c
                    break
                if update_between_siblings:
                    residual = np.maximum(p - q, 0)
                    p = normalize(residual) if renormalize else residual
                    if not use_residual:
                        p = p_rows[node].copy()
            else:
                if renormalize:
                    return path, sample_from(p, u[0])
                return path, int(min(np.count_nonzero(np.cumsum(p) <= u[0]), len(p) - 1))

    return rule


MUTANTS = {
    "residual not renormalised": (mutant(renormalize=False), CHAIN, True),
    "resample from p instead of the residual": (mutant(use_residual=False), CHAIN, True),
    "accept with p(x), ignoring q": (mutant(use_q=False), CHAIN, True),
    "no residual update between siblings": (mutant(update_between_siblings=False), TREE, False),
}


def test_the_sequential_reference_rule_passes():
    params = PARAMS["t1"]
    result = chi_square(speculative_sequences(mutant(), TREE, True, params, seed=11), exact_distribution(params))
    assert result.verdict == "pass", result.to_dict()


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_wrong_rules_are_caught(name):
    rule, shape, stochastic = MUTANTS[name]
    params = PARAMS["t1"]
    result = chi_square(speculative_sequences(rule, shape, stochastic, params, seed=7), exact_distribution(params))
    assert result.verdict == "fail", f"{name} was not caught: {result.to_dict()}"
