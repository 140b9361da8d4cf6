"""eagle3-suffix (runtime/drafters/hybrid.py): the suffix tree drafts where this sequence's record says its
draft would be accepted (priced on a verify cost curve against the learned drafter's predicted speed-up, or
by a threshold), the learned drafter elsewhere; each step's proposal is one drafter's (the suffix draft
possibly cut to its best prefix).
The learned drafter is a stand-in here (one fixed draft, counting its calls); test_lossless_every_drafter.py
runs eagle3-suffix itself, batch-1 and served, equal to plain greedy output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.costs import CostCurve
from specrt.runtime.drafters import Drafter, DrafterContext, Proposal
from specrt.runtime.drafters.hybrid import PRIOR, SuffixFirst, accepted_of
from specrt.runtime.drafters.suffix import Suffix
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.shapes import Shape
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


# a CPU's verify cost by rows (a pass of 4 rows costs 1.2 one-row passes), and a head sized on it: a chain of one
# draft accepted at 0.55, predicted at 1.3x plain
CURVE = CostCurve((1, 2, 4, 8, 16), (1.0, 1.05, 1.2, 1.6, 2.5))
A1, HEAD_SPEEDUP = 0.55, 1.3


class SizedHead(Head):
    def __init__(self, ctx: DrafterContext):
        super().__init__(ctx)
        self.chosen = Shape(1, HEAD_SPEEDUP, (A1,), "test")


class SizedHeadSuffixFirst(SuffixFirst):
    name = "sized-head-suffix"
    learned = SizedHead


def priced(curve=CURVE, **options) -> SizedHeadSuffixFirst:
    return SizedHeadSuffixFirst(DrafterContext(Path("."), None, 4096, 1, Tree.chain(5), options, costs=lambda: curve))


def speedup(scores: list[float], k: int, record: float = 1.0) -> float:
    """S_s(k) of the module doc: a suffix draft's first k nodes, per plain pass's time."""
    return (1 + record * sum(scores[:k])) * CURVE(1) / CURVE(1 + k)


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


def test_the_priced_rule_takes_the_suffix_prefix_that_pays_most():
    d = priced()
    assert d.curve is CURVE and d.head_acceptance == pytest.approx(A1)
    # two likely nodes, then two unlikely ones: their rows cost more than they are expected to bring
    scores = [0.95, 0.9, 0.05, 0.05]
    assert d.choose(scores) == 2
    assert speedup(scores, 2) > max(HEAD_SPEEDUP, speedup(scores, 1), speedup(scores, 3), speedup(scores, 4))
    # a lone draft likely enough to beat the head wins, though it expects less than the threshold's 1 token
    assert d.choose([0.5]) == 1 and speedup([0.5], 1) > HEAD_SPEEDUP
    assert hybrid().choose([0.5]) == 0  # the threshold rule refuses it
    assert d.choose([0.2]) == 0 and speedup([0.2], 1) < HEAD_SPEEDUP  # the head pays more
    assert d.choose([]) == 0


def test_a_priced_step_proposes_the_cut_draft_and_records_its_score():
    d = priced()
    tokens = PATTERN * 3  # one repeat of the pattern: every suffix node at probability 1, each pays its row
    got = step(d, tokens, PATTERN[:2] + [PATTERN[2]])
    assert got.tokens == PATTERN[:5] and got.parents == [0, 1, 2, 3, 4] and got.q is None
    assert d.scored == 5 and d.accepted == 2 and d.model.calls == 0
    d2 = priced(curve=CostCurve((1, 2, 4, 8), (1.0, 1.05, 3.0, 6.0)))  # a machine where rows past 2 are dear
    got = d2.propose(PATTERN * 3, 16, 16, GREEDY, RNG)
    assert got.tokens == PATTERN[:1] and d2.suffix_steps == 1  # cut to the one node that pays its row


def test_the_heads_own_record_moves_the_choice():
    d = priced()
    tokens = list(range(100, 160))
    for _ in range(6):  # text that does not repeat: the head drafts, and its draft (99) is always rejected
        assert step(d, tokens, [2000 + len(tokens)]) is d.model.draft
    assert d.drafted == 6 and d.head_accepted == 0
    assert d.head_acceptance == pytest.approx(PRIOR * A1 / (6 + PRIOR))
    # a draft the fresh head beats now beats the head that fails on this text
    assert priced().choose([0.3]) == 0 and d.choose([0.3]) == 1
    step(d, tokens, [99, 5])  # a head draft accepted
    assert d.head_accepted == 1 and d.drafted == 7


def test_a_given_threshold_or_no_curve_or_no_sized_head_keeps_the_threshold_rule():
    assert priced(suffix_threshold=1.0).curve is None  # the user's threshold is honoured, not priced away
    assert priced(curve=None).curve is None
    assert hybrid().curve is None  # a learned drafter with no Shape: nothing to price it against
    d = priced(suffix_threshold=0.4)
    assert d.choose([0.5]) == 1 and d.choose([0.2, 0.1]) == 0 and d.choose([0.95, 0.9, 0.05, 0.05]) == 4
