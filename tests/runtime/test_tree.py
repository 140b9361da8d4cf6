"""Trees compile from paths into parents, ranks, depths and ancestor masks."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Proposal
from specrt.runtime.drafters.ngram import continuations, trie
from specrt.runtime.tree import NAMED_TREES, Tree, resolve_tree


def test_paths_compile_as_documented():
    t = Tree.from_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    assert t.parents == (-1, 0, 0, 1, 1, 3)
    assert t.ranks == (0, 0, 1, 0, 1, 0)
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.mask[5].tolist() == [True, True, False, True, False, True]
    assert t.mask[2].tolist() == [True, False, True, False, False, False]
    assert t.paths == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    assert Tree.from_paths(t.paths) == t


def test_order_of_paths_does_not_matter_and_chain_is_a_tree():
    assert Tree.from_paths([[0, 0], [1], [0]]) == Tree.from_paths([[0], [1], [0, 0]])
    chain = Tree.chain(3)
    assert chain == Tree.from_paths([[0], [0, 0], [0, 0, 0]])
    assert chain.is_chain and np.array_equal(chain.mask, np.tril(np.ones((4, 4), bool)))


def test_from_parents_assigns_ranks_in_order():
    t = Tree.from_parents([-1, 0, 0, 1, 0])
    assert t.ranks == (0, 0, 1, 0, 2)
    assert t.children(0) == [1, 2, 4]


@pytest.mark.parametrize("paths,needle", [([[0], [0]], "duplicates"), ([[0, 0]], "no parent"),
                                          ([[1]], "skips rank"), ([[]], "invalid"), ([[0], [-1]], "invalid")])
def test_bad_paths_are_refused(paths, needle):
    with pytest.raises(SpecrtError, match=needle):
        Tree.from_paths(paths)


def test_resolve_names_files_and_errors(tmp_path):
    assert resolve_tree(None, 4) == Tree.chain(4)
    for name in NAMED_TREES:
        assert resolve_tree(name, 4).size == len(NAMED_TREES[name]) + 1
    f = tmp_path / "t.json"
    f.write_text(json.dumps([[0], [1], [0, 0]]))
    assert resolve_tree(str(f), 4).size == 4
    f.write_text("{oops")
    with pytest.raises(SpecrtError, match="t.json"):
        resolve_tree(str(f), 4)
    with pytest.raises(SpecrtError, match="neither a tree name"):
        resolve_tree("no-such-tree", 4)


def test_proposal_limits_keep_a_valid_tree():
    p = Proposal([10, 11, 12, 13, 14], [0, 0, 1, 1, 3], None)  # depths 1 1 2 2 3
    assert p.limited(10, 1).tokens == [10, 11]
    q = p.limited(4, 2)
    assert q.tokens == [10, 11, 12, 13] and q.parents == [0, 0, 1, 1]
    r = p.limited(5, 3)
    assert r is p
    assert p.limited(0, 3).tokens == []


def test_ngram_trie_merges_shared_prefixes():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 7, 2, 3]
    conts = continuations(tokens, k=2, max_n=2, limit=3)
    assert conts[:2] == [[5, 7], [4, 9]]  # latest occurrence of [2, 3] first
    prop = trie([[5, 7], [5, 8], [4]], max_nodes=10)
    assert prop.tokens == [5, 7, 8, 4] and prop.parents == [0, 1, 1, 0]
    assert trie([[5, 7], [4]], max_nodes=2).tokens == [5, 7]


def test_an_empty_tree_is_refused_not_plain_decoding(tmp_path):
    """[] compiled to the root alone: every step drafted nothing, silently plain decoding."""
    with pytest.raises(SpecrtError, match=r"tree paths \[\] are empty: .*--drafter plain.*omit --tree"):
        Tree.from_paths([])
    f = tmp_path / "empty.json"
    f.write_text("[]")
    with pytest.raises(SpecrtError, match=rf"^{re.escape(str(f))}: the tree is empty \(\[\]\): .*--drafter plain"):
        resolve_tree(str(f), 4)


@pytest.mark.parametrize("content", ["[[true]]", "[[0], [false]]", "[[0.0]]"])
def test_tree_files_need_integer_ranks(tmp_path, content):
    """true is an int to Python: [[0], [false]] read as [[0], [0]], [[true]] as [[1]]."""
    f = tmp_path / "t.json"
    f.write_text(content)
    with pytest.raises(SpecrtError, match="lists of integers, not true/false"):
        resolve_tree(str(f), 4)


def test_a_shape_is_compiled_once_and_its_arrays_cannot_be_changed_by_a_step():
    a, b = Tree.from_parents([-1, 0, 0, 1]), Tree.from_parents([-1, 0, 0, 1])
    assert a is b and Tree.chain(3) is Tree.from_parents([-1, 0, 1, 2])
    assert Tree.chain(3) is not Tree.chain(2)
    for arr in (a.mask, a.depth, Tree.chain(2).mask, Tree.chain(2).depth):
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 0
    assert a.mask.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    with pytest.raises(SpecrtError, match="invalid tree parents"):  # a refusal is not remembered as a tree
        Tree.from_parents([-1, 1])
    with pytest.raises(SpecrtError, match="invalid tree parents"):
        Tree.from_parents([-1, 1])
