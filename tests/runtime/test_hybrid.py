"""eagle3-suffix (runtime/drafters/hybrid.py): the suffix tree drafts where this sequence's record says its
draft would be accepted, the learned drafter elsewhere; each step's proposal is one drafter's, unchanged.
The learned drafter is a stand-in here (one fixed draft, counting its calls); test_lossless_every_drafter.py
runs eagle3-suffix itself, batch-1 and served, equal to plain greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.hybrid import PRIOR, SuffixFirst, accepted_of
from specrt.runtime.drafters.suffix import Suffix
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import Tree

GREEDY = SamplingParams()
RNG = np.random.default_rng(0)
PATTERN = [11, 12, 13, 14, 15, 16, 17, 18]


class Head(Drafter):
    """The learned drafter's stand-in: one draft, with a q of its own, whatever the context."""

    name = "head"

    def __init__(self, ctx: DrafterContext):
        self.calls, self.observed, self.finished = 0, [], 0
        self.draft = Proposal([99], [0], np.full((1, 4), 0.25, np.float32))

    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        self.calls += 1
        return self.draft

    def observe(self, tokens, state=None) -> None:
        self.observed.append(len(tokens))

    def finish(self, tokens) -> None:
        self.finished += 1


class HeadSuffixFirst(SuffixFirst):
    name = "head-suffix"
    learned = Head


def hybrid(**options) -> HeadSuffixFirst:
    return HeadSuffixFirst(DrafterContext(Path("."), None, 4096, 1, Tree.chain(5), options))


def step(d: HeadSuffixFirst, tokens: list[int], committed: list[int]) -> Proposal:
    """One step: propose after `tokens`, then observe them extended by `committed` (drafts accepted + the
    target's token); `tokens` is extended in place."""
    proposal = d.propose(tokens, 16, 16, GREEDY, RNG)
    tokens.extend(committed)
    d.observe(tokens)
    return proposal


def test_accepted_of_follows_the_committed_tokens_down_the_draft():
    chain = Proposal([5, 6, 7], [0, 1, 2])
    assert accepted_of(chain, [5, 6, 7, 8]) == 3  # all, then the target's own token
    assert accepted_of(chain, [5, 6, 9]) == 2
    assert accepted_of(chain, [9]) == 0
    assert accepted_of(chain, [5, 6]) == 1  # the last committed token is the target's, never a draft
    tree = Proposal([5, 4, 6], [0, 0, 1])  # 5 and 4 under the root, 6 under 5
    assert accepted_of(tree, [4, 2]) == 1
    assert accepted_of(tree, [5, 6, 1]) == 2
    assert accepted_of(tree, [6, 1]) == 0  # 6 is not the root's child


def test_text_that_repeats_drafts_from_the_suffix_tree():
    d = hybrid()
    tokens = PATTERN * 3
    want = Suffix(DrafterContext(Path("."), None, 4096, 1, Tree.chain(5), {})).scored(tokens, 16, 16)
    got = d.propose(tokens, 16, 16, GREEDY, RNG)
    assert want[1] >= 1 and got.tokens == want[0].tokens == PATTERN[:5]
    assert d.model.calls == 0 and d.suffix_steps == 1 and got.q is None  # deterministic: one-hot q


def test_text_that_does_not_repeat_drafts_from_the_head():
    d = hybrid()
    tokens = list(range(100, 140))
    assert d.propose(tokens, 16, 16, GREEDY, RNG) is d.model.draft  # the head's proposal, unchanged (its q too)
    assert d.model.calls == 1 and d.suffix_steps == 0


def test_rejected_suffix_drafts_hand_the_sequence_to_the_head_and_a_new_one_starts_afresh():
    d = hybrid()
    tokens = PATTERN * 2
    used = []
    for _ in range(6):  # the text breaks the pattern every step: each suffix draft is rejected at once
        before = d.suffix_steps
        step(d, tokens, [1000 + len(tokens)])
        used.append(d.suffix_steps > before)
    assert used[0] and not all(used)  # the suffix drafted first, then lost the sequence to the head
    assert d.accepted == 0 and d.record == pytest.approx(PRIOR / (d.scored + PRIOR)) and d.record < 1
    assert d.model.observed[-1] == len(tokens)  # the head kept up with every committed token
    step(d, list(range(500, 600)), [3])  # longer, but not this sequence's continuation: another prompt
    assert d.scored == d.accepted == 0 and d.record == 1
    d.scored = 5.0
    step(d, [7, 8], [9])  # a shorter sequence: another prompt
    assert d.scored == d.accepted == 0 and d.record == 1


def test_accepted_suffix_drafts_keep_the_record():
    d = hybrid()
    tokens = PATTERN * 3
    draft = step(d, tokens, PATTERN[:5] + [PATTERN[5]])  # every draft accepted, then the target's token
    assert draft.tokens == PATTERN[:5] and d.accepted == 5 and d.scored == 5 and d.record == 1  # as scored
    assert d.propose(tokens, 16, 16, GREEDY, RNG).q is None and d.model.calls == 0


def test_the_threshold_decides_and_a_negative_one_is_refused():
    tokens = PATTERN * 3
    high = hybrid(suffix_threshold=100.0)
    assert high.propose(tokens, 16, 16, GREEDY, RNG) is high.model.draft
    low = hybrid(suffix_threshold=0.0)
    assert low.propose(list(range(100, 140)) + [100], 16, 16, GREEDY, RNG).q is None  # any suffix draft
    with pytest.raises(SpecrtError, match="suffix_threshold -1.0 is below 0"):
        hybrid(suffix_threshold=-1.0)


def test_slots_share_the_suffix_store_and_finish_resets_the_record():
    a, b = hybrid(), hybrid()
    b.share(a)
    a.finish(PATTERN * 2)  # a's finished sequence is in the store both read
    assert a.model.finished == 1 and a.record == 1
    got = b.propose(PATTERN[:6], 16, 16, GREEDY, RNG)
    assert b.model.calls == 0 and got.tokens[:2] == PATTERN[6:8]
