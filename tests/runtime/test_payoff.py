"""`--drafter auto`: the per-request choice follows measured pay-off (acceptance and cost, against plain
decoding's rate), explores what it has not measured, and never changes what is committed."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.generate import Generator
from specrt.runtime.payoff import DrafterChoice, Payoff, payoff
from specrt.runtime.pool import candidates
from specrt.runtime.sampling import SamplingParams

VERIFY = lambda n: 0.010 + 0.001 * n  # noqa: E731 — seconds of a verify pass over n window rows


def measured(accept: float, propose_per_depth: float, verify=VERIFY, k: int = 4, steps: int = 240,
             seed: int = 0) -> AdaptiveDepth:
    """A controller fed synthetic steps: depths 0..k in turn, each drafted depth accepted with probability
    `accept` given the one before it, proposing costing `propose_per_depth` per depth."""
    ctrl, rng = AdaptiveDepth(k), np.random.default_rng(seed)
    for i in range(steps):
        depth = i % (k + 1)
        accepted = 0
        while accepted < depth and rng.random() < accept:
            accepted += 1
        ctrl.update(depth, np.arange(1, depth + 1), accepted, propose_per_depth * depth, verify(1 + depth))
    return ctrl


def exploit(payoffs: dict) -> str:
    """What a choice picks once every candidate is measured (nothing left to explore or revisit)."""
    return DrafterChoice(list(payoffs)).choose(payoffs).drafter


def test_payoff_is_the_adaptive_model_over_plain():
    ctrl = measured(0.8, 1e-4)
    p = payoff(ctrl)
    rates = ctrl.rates()
    assert p.plain == pytest.approx(rates[0]) and p.rate == pytest.approx(rates[1:].max())
    assert p.depth == 1 + int(rates[1:].argmax()) and p.speedup > 1.5
    assert payoff(AdaptiveDepth(4)) is None and payoff(None) is None  # nothing measured yet


def test_cost_decides_between_drafters():
    """"slow" is accepted more often but proposing costs more than it gains: the cheap one pays more. A rule
    that ignored the propose cost (acceptance alone, or tokens per verify pass) would pick "slow"."""
    slow, cheap = payoff(measured(0.8, 6e-3)), payoff(measured(0.5, 1e-4))
    assert slow.speedup < cheap.speedup
    assert exploit({"slow": slow, "cheap": cheap}) == "cheap"


def test_acceptance_decides_between_drafters():
    """Two cheap drafters, "cheaper" costing the least but rarely accepted: the better accepted one pays
    more. A rule that ignored acceptance (cost alone) would pick "cheaper"."""
    good, cheaper = payoff(measured(0.75, 5e-4)), payoff(measured(0.3, 1e-5))
    assert good.speedup > cheaper.speedup
    assert exploit({"cheaper": cheaper, "good": good}) == "good"


def test_plain_when_no_drafter_beats_it():
    """Verify cost proportional to the window and little acceptance: every drafter predicts less than plain
    decoding's rate, so the request runs plain (a rule picking the best drafter regardless would not)."""
    steep = lambda n: 0.010 * n  # noqa: E731
    pays = {"a": payoff(measured(0.1, 1e-4, steep)), "b": payoff(measured(0.3, 1e-3, steep, seed=1))}
    assert all(p.speedup < 1 for p in pays.values())
    assert exploit(pays) == "plain"


def test_choice_uses_the_speedup_not_the_absolute_rate():
    """Rates measured at different machine speeds: "a" was measured while everything ran twice as slow,
    yet pays more relative to plain decoding measured alongside it."""
    a, b = Payoff(rate=150.0, plain=60.0, depth=3), Payoff(rate=200.0, plain=120.0, depth=3)
    assert exploit({"a": a, "b": b}) == "a"


def test_unmeasured_candidates_are_explored_first_then_the_best_runs():
    choice = DrafterChoice(["ngram", "draft", "suffix"], explore=2)
    good, poor = Payoff(300.0, 100.0, 4), Payoff(90.0, 100.0, 2)
    known = {"ngram": poor, "draft": None, "suffix": None}
    assert [choice.choose(known).drafter for _ in range(2)] == ["draft", "draft"]  # measured ones are not explored
    known["draft"] = good
    assert (p := choice.choose(known)).drafter == "suffix" and p.reason == "explore"
    assert choice.choose(known).reason == "explore"  # still unmeasured (a short request): its second try
    assert (p := choice.choose(known)).drafter == "draft" and p.reason == "pays"
    assert p.speedup == {"ngram": 0.9, "draft": 3.0, "suffix": None}


def test_a_drafter_that_stops_paying_is_dropped_for_plain_and_revisited_with_backoff():
    choice = DrafterChoice(["ngram"], explore=1, revisit=3, max_revisit=12)
    assert choice.choose({"ngram": None}).reason == "explore"
    assert choice.choose({"ngram": Payoff(200.0, 100.0, 3)}).drafter == "ngram"
    bad = {"ngram": Payoff(80.0, 100.0, 1)}  # the text changed: it no longer pays
    picks = [choice.choose(bad) for _ in range(40)]
    revisits = [i for i, p in enumerate(picks) if p.reason == "revisit"]
    assert all(p.drafter == "plain" for p in picks if p.reason != "revisit")
    assert np.all(np.diff(revisits) > 3) and np.diff(revisits).tolist() == sorted(np.diff(revisits).tolist())
    assert len(revisits) >= 3 and np.diff(revisits)[-1] == 13  # doubling gaps, capped at max_revisit
    picks = [choice.choose({"ngram": Payoff(200.0, 100.0, 3)}) for _ in range(5)]  # it pays again
    assert [p.drafter for p in picks].count("ngram") >= 1


def test_revisits_of_many_losers_are_spread_out():
    losers = {d: Payoff(50.0, 100.0, 1) for d in "abcdef"}
    choice = DrafterChoice([*losers, "win"], revisit=8, revisit_gap=4)
    pays = {**losers, "win": Payoff(200.0, 100.0, 3)}
    picks = [choice.choose(pays) for _ in range(48)]
    revisits = [i for i, p in enumerate(picks) if p.reason == "revisit"]
    assert len(revisits) >= 4 and min(np.diff(revisits)) >= 4  # never two within the gap
    assert sum(p.drafter == "win" for p in picks) >= 0.75 * len(picks)


def test_margin_keeps_plain_when_a_drafter_barely_beats_it():
    assert exploit({"a": Payoff(101.0, 100.0, 1)}) == "plain"
    assert exploit({"a": Payoff(110.0, 100.0, 1)}) == "a"


# ── on the test bundle: output unchanged, the drafter each request used recorded ──────────────────
PROMPTS = [[3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5], [7, 8, 9, 10, 7, 8, 9], [20, 21, 22, 23, 24, 25, 20, 21],
           [5, 5, 5, 5, 5, 5], [30, 31, 30, 31, 30], [40, 41, 42, 43, 44, 45, 46, 47, 40, 41, 42]]


def test_auto_greedy_equals_plain_and_records_the_drafter(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="auto", max_seq_len=64, num_draft_tokens=4)
    plain = [gen.use("plain").generate_ids(p, 30).token_ids for p in PROMPTS]
    gen.use("auto")
    assert gen.requested_drafter == "auto" and gen.drafter_label == "auto"
    used, accepted = [], 0
    for i, prompt in enumerate(PROMPTS * 2):  # second round: every candidate has been explored
        res = gen.generate_ids(prompt, 30)
        assert res.token_ids == plain[i % len(PROMPTS)], (prompt, res.drafter)
        assert res.drafter == gen.last_pick.drafter == gen.drafter_name
        used.append(res.drafter)
        accepted += res.stats.accepted
    assert accepted > 0  # drafts were accepted: not plain held to plain
    assert set(gen.choice.candidates) <= set(used)  # each candidate was tried …
    assert set(gen.choice.candidates) == {"ngram", "draft", "suffix"} & set(candidates(gen.model))
    assert gen.choice.requests == len(used)  # … and the statistics are the generator's, across requests


def test_auto_candidates_restrict_the_choice_and_are_checked(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="auto", max_seq_len=64, auto_candidates=["ngram"])
    assert gen.choice.candidates == ["ngram"]
    assert {gen.generate_ids(p, 12).drafter for p in PROMPTS[:3]} <= {"ngram", "plain"}
    with pytest.raises(SpecrtError, match="unknown drafter 'nope'"):
        Generator(tiny_bundle, max_seq_len=64, auto_candidates=["nope"])
    with pytest.raises(SpecrtError, match="'medusa' is not in bundle"):
        Generator(tiny_bundle, max_seq_len=64, auto_candidates=["medusa"])


def test_auto_sampling_passes_the_drafters_q(tiny_bundle, monkeypatch):
    """With sampling the chosen drafter's distributions reach the rejection rule (the draft model's q)."""
    from specrt.runtime import sequence

    seen = []
    accept = sequence.Sequence._accept

    def spy(self, p, logits):
        if len(p.proposal):
            seen.append(p.proposal.q is not None)
        return accept(self, p, logits)

    monkeypatch.setattr(sequence.Sequence, "_accept", spy)
    gen = Generator(tiny_bundle, drafter="auto", max_seq_len=64, auto_candidates=["draft"])
    res = gen.generate_ids(PROMPTS[0], 20, SamplingParams(temperature=0.8, seed=3))
    assert res.drafter == "draft" and seen and all(seen)


@pytest.mark.slow
def test_auto_real_model_equals_plain(real_generator):
    """On the real model (drafts accepted: the choice compares drafters that pay), greedy auto output is
    plain's on prompts of every kind, whichever drafter each request chose."""
    gen = real_generator
    prompts = ["List the numbers from 1 to 20, separated by commas.", "Say hi.",
               "Repeat exactly: the cat sat on the mat, the cat sat on the mat."]
    ids = [gen.tokenizer.encode_prompt(p) for p in prompts]
    plain = [gen.use("plain").generate_ids(x, 32).token_ids for x in ids]
    accepted = 0
    try:
        gen.use("auto")
        for x, want in zip(ids * 2, plain * 2, strict=True):
            res = gen.generate_ids(x, 32)
            assert res.token_ids == want, res.drafter
            accepted += res.stats.accepted
    finally:
        gen.use("plain")
    assert sum(gen.pool.choice(None, serving=False).picks.values()) == 2 * len(prompts)
    assert accepted > 0  # drafts were accepted: not plain held to plain
