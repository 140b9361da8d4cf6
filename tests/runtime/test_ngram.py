"""Prompt lookup: longest suffix first, latest occurrence, bounded by k, no self-match."""

from __future__ import annotations

import pytest

from specrt.errors import SpecrtError
from specrt.runtime.drafters.ngram import lookup

pytestmark = pytest.mark.covers("proposal", kinds=("ngram",))


def test_longest_suffix_wins_over_shorter():
    # suffix [2, 3] occurs at 1 (followed by 9) ; suffix [3] alone occurs later at 6 (followed by 7)
    tokens = [1, 2, 3, 9, 9, 5, 3, 7, 4, 2, 3]
    assert lookup(tokens, k=2, max_n=2, min_n=1) == [9, 9]
    assert lookup(tokens, k=2, max_n=1, min_n=1) == [7, 4]


def test_latest_occurrence_is_used():
    tokens = [5, 1, 10, 5, 1, 20, 5, 1]
    assert lookup(tokens, k=1, max_n=2) == [20]


def test_proposal_is_cut_at_k_at_twice_the_match_and_at_the_end_of_context():
    tokens = [4, 5, 6, 7, 8, 4, 5]
    assert lookup(tokens, k=2, max_n=2) == [6, 7]
    assert lookup(tokens, k=10, max_n=2) == [6, 7, 8, 4]  # 2-token match: at most 4
    assert lookup(tokens, k=10, max_n=1) == [6, 7]  # 1-token match: at most 2
    assert lookup([1, 2, 3, 9, 1, 2, 3], k=10, max_n=3) == [9, 1, 2, 3]  # cut by the context's end


def test_overlapping_repeat_uses_the_latest_match():
    tokens = [3, 3, 3, 3]
    # suffix [3, 3] occurs at 0 and 1 (not at 2: that is the suffix itself); latest is 1 → tokens[3:]
    assert lookup(tokens, k=4, max_n=2) == [3]


def test_no_match_and_tiny_contexts():
    assert lookup([1, 2, 3, 4], k=3) == []
    assert lookup([7], k=3) == []
    assert lookup([], k=3) == []
    assert lookup([1, 1], k=3) == [1]
    assert lookup([1, 2, 1], k=0) == []


def test_min_n_excludes_short_matches():
    tokens = [9, 2, 8, 1, 2]
    assert lookup(tokens, k=2, max_n=3, min_n=1) == [8, 1]
    assert lookup(tokens, k=2, max_n=3, min_n=2) == []


@pytest.mark.parametrize("max_n,min_n", [(1, 2), (3, 0)])
def test_invalid_sizes_are_refused(max_n, min_n):
    with pytest.raises(SpecrtError, match="min_n"):
        lookup([1, 2, 1], k=2, max_n=max_n, min_n=min_n)
