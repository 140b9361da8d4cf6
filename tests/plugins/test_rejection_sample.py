"""specrt::RejectionSample / GreedyAccept: the ONNX function bodies (through ONNX Runtime, as the
runtime calls them) equal the sequential NumPy references, on random trees and edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.plugins import rejection_sample as rs
from specrt.runtime.acceptance import Window, greedy, greedy_op, one_hot_rows, rejection
from specrt.runtime.sampling import SamplingParams, warp
from specrt.runtime.tree import Tree

TREES = [Tree.chain(0), Tree.chain(1), Tree.chain(5), Tree.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
         Tree.from_paths([[0], [1], [2], [3]])]
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)


def replay(rng_state, n):
    rng = np.random.default_rng()
    rng.bit_generator.state = rng_state
    return rng.random(n, dtype=np.float32)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.size}nodes")
@pytest.mark.parametrize("stochastic", [False, True])
def test_rejection_op_matches_reference(tree, stochastic):
    rng = np.random.default_rng(tree.size * 2 + stochastic)
    vocab = 10
    for _ in range(150):
        logits = (2 * rng.normal(size=(tree.size, vocab))).astype(np.float32)
        tokens = rng.integers(0, vocab, tree.size)
        q = rng.dirichlet(np.ones(vocab) * 0.5, size=tree.size).astype(np.float32) if stochastic else None
        state = rng.bit_generator.state
        path, nxt = rejection(Window(tokens, tree, q), logits, PARAMS, rng)
        u = replay(state, tree.size)
        qq = q if stochastic else one_hot_rows(tokens, vocab)
        assert (path, nxt) == rs.rejection_sample_reference(warp(logits, PARAMS), qq, tokens, tree.parents, u)


@pytest.mark.parametrize("tree", TREES, ids=lambda t: f"{t.size}nodes")
def test_greedy_op_matches_reference(tree):
    rng = np.random.default_rng(tree.size)
    for _ in range(150):
        logits = rng.normal(size=(tree.size, 6)).astype(np.float32)
        tokens = rng.integers(0, 6, tree.size)
        want = rs.greedy_accept_reference(logits, tokens, tree.parents)
        assert greedy_op(Window(tokens, tree), logits, SamplingParams(), rng) == want  # the ONNX function
        assert greedy(Window(tokens, tree), logits, SamplingParams(), rng) == want  # the runtime's host walk


@pytest.mark.parametrize("greedy", [greedy, greedy_op], ids=["host_walk", "onnx_function"])
def test_edge_cases(greedy):
    tree = Tree.from_paths([[0], [1], [0, 0], [0, 0, 0]])  # window: 0 root, 1 (0), 2 (1), 3 (0,0), 4 (0,0,0)
    vocab, rng = 5, np.random.default_rng(0)
    logits = np.full((5, vocab), -10.0, np.float32)
    best = [1, 2, 3, 4, 0]  # argmax at each node
    logits[np.arange(5), best] = 10.0
    # deepest path accepted: node 1 holds argmax(root)=1, node 3 argmax(node 1)=2, node 4 argmax(node 3)=4
    tokens = np.array([0, 1, 4, 2, 4])
    assert greedy(Window(tokens, tree), logits, SamplingParams(), rng) == ([1, 3, 4], 0)
    # root rejected: no child holds argmax(root); the second sibling is tried too
    tokens = np.array([0, 3, 1, 2, 3])
    assert greedy(Window(tokens, tree), logits, SamplingParams(), rng) == ([2], 3)
    tokens = np.array([0, 3, 4, 2, 3])
    assert greedy(Window(tokens, tree), logits, SamplingParams(), rng) == ([], 1)
    # single node (nothing drafted)
    assert greedy(Window(np.array([0]), Tree.chain(0)), logits[:1], SamplingParams(), rng) == ([], 1)


def test_sampling_accepts_a_certain_draft_and_rejects_an_impossible_one():
    tree = Tree.chain(2)
    rng = np.random.default_rng(0)
    logits = np.full((3, 4), -30.0, np.float32)
    logits[0, 1] = logits[1, 2] = logits[2, 3] = 30.0  # target nearly deterministic: 1, 2, 3
    params = SamplingParams(temperature=1.0)
    for _ in range(20):
        assert rejection(Window(np.array([0, 1, 2]), tree), logits, params, rng) == ([1, 2], 3)
        assert rejection(Window(np.array([0, 0, 2]), tree), logits, params, rng) == ([], 1)
