"""The static-tree level walk the draft model, EAGLE-1 and Medusa share (runtime/drafters/static_tree.py),
on hand-made distributions whose proposals are known."""

from __future__ import annotations

import numpy as np

from specrt.runtime.drafters.static_tree import expand_static
from specrt.runtime.sampling import SamplingParams, top_desc
from specrt.runtime.tree import Tree

V = 10
# window 1:(0) 2:(1) 3:(0,0) 4:(0,1) 5:(1,0) 6:(0,0,0)
SHAPE = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])


def after(token: int) -> np.ndarray:
    """Logits under a node holding `token`: rank r is token + r + 1 (mod V), no ties."""
    return -((np.arange(V) - token - 1) % V).astype(np.float32)


class HandMade:
    """A drafter whose logits at a node depend on the node's token (root token 0), known after `evaluate`."""

    def __init__(self):
        self.logits = {0: after(0)}
        self.calls: list[tuple[list[int], dict[int, int]]] = []

    def ranked(self, p: int, n: int) -> np.ndarray:
        return top_desc(self.logits[p], n)

    def evaluate(self, level: list[int], drafted: dict[int, int]) -> None:
        self.calls.append((list(level), dict(drafted)))
        for i in level:
            self.logits[i] = after(drafted[i])


def test_greedy_children_are_the_parents_top_candidates_in_rank_order():
    d = HandMade()
    prop = expand_static(SHAPE, SHAPE.kept(64, 64), SamplingParams(), np.random.default_rng(0),
                         ranked=d.ranked, dist=None, evaluate=d.evaluate)
    # root 0 -> 1, 2; node 1 (1) -> 2, 3; node 2 (2) -> 3; node 3 (2) -> 3
    assert prop.tokens == [1, 2, 2, 3, 3, 3]
    assert prop.parents == [0, 0, 1, 1, 2, 3]
    assert prop.q is None
    # one evaluation per level that has children, none after the last level
    assert d.calls == [([1, 2], {1: 1, 2: 2}), ([3, 4, 5], {1: 1, 2: 2, 3: 2, 4: 3, 5: 3})]


def test_limits_keep_a_window_prefix_within_the_depth():
    assert SHAPE.kept(64, 2) == [1, 2, 3, 4, 5]
    assert SHAPE.kept(3, 64) == [1, 2, 3]
    assert SHAPE.kept(0, 64) == SHAPE.kept(64, 0) == []
    d = HandMade()
    prop = expand_static(SHAPE, SHAPE.kept(4, 64), SamplingParams(), None, ranked=d.ranked, dist=None,
                         evaluate=d.evaluate)
    assert (prop.tokens, prop.parents) == ([1, 2, 2, 3], [0, 0, 1, 1])
    assert [level for level, _ in d.calls] == [[1, 2]]  # node 2 has no kept child, still one pass per level
    assert expand_static(SHAPE, [], SamplingParams(), None, ranked=d.ranked, dist=None).tokens == []


class FixedUniforms:
    def __init__(self, values):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_sampling_draws_each_child_from_its_parents_distribution_in_window_order():
    q_root = np.array([0.5, 0.25, 0.25, 0, 0], np.float32)  # u < .5 -> 0, < .75 -> 1, else 2
    q_node = {0: q_root, 1: np.array([0, 0, 0, 1, 0], np.float32), 2: np.array([0, 0, 0, 0, 1], np.float32),
              3: np.array([0, 1, 0, 0, 0], np.float32)}
    shape = Tree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0]])
    prop = expand_static(shape, shape.kept(64, 64), SamplingParams(temperature=1.0),
                         FixedUniforms([0.9, 0.1, 0.6, 0.3, 0.6]), ranked=None, dist=lambda p: q_node[p],
                         evaluate=lambda level, drafted: None)
    # root draws u=.9 -> 2, u=.1 -> 0; node 1's children are point masses on 3; node 2's on 4
    assert prop.tokens == [2, 0, 3, 3, 4]
    assert prop.parents == [0, 0, 1, 1, 2]
    np.testing.assert_array_equal(prop.q, np.stack([q_root, q_root, q_node[1], q_node[1], q_node[2]]))


def test_medusa_style_distributions_by_depth_need_no_evaluation():
    heads = [after(0), after(5)]  # head d drafts depth d + 1 for every parent at depth d
    prop = expand_static(SHAPE, SHAPE.kept(64, 2), SamplingParams(), None,
                         ranked=lambda p, n: top_desc(heads[int(SHAPE.depth[p])], n), dist=None)
    assert prop.tokens == [1, 2, 6, 7, 6]
    assert prop.parents == [0, 0, 1, 1, 2]
