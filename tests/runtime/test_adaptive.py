"""Adaptive draft depth: the controller's choices follow acceptance and cost; output never changes."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.clock import FakeClock
from specrt.runtime.generate import Generator
from tests.scripted import Script, ScriptedDrafter, paced

VERIFY_S = 0.01  # what a target pass costs on a test's fake clock, whatever its rows


def drive(ctrl: AdaptiveDepth, accept_prob: float, verify_cost, steps: int, seed: int = 0) -> list[int]:
    """Simulate steps where each drafted depth is accepted with `accept_prob` (given the previous one);
    returns the depth chosen at every step."""
    rng = np.random.default_rng(seed)
    chosen = []
    for _ in range(steps):
        depth = ctrl.choose().depth
        chosen.append(depth)
        accepted = 0
        while accepted < depth and rng.random() < accept_prob:
            accepted += 1
        ctrl.update(depth, np.arange(1, depth + 1), accepted, 1e-4 * depth, verify_cost(1 + depth))
    return chosen


def test_high_acceptance_with_flat_verify_cost_drafts_deep():
    chosen = drive(AdaptiveDepth(6), 0.95, lambda n: 0.010 + 0.0002 * n, 200)
    assert np.mean(chosen[50:]) >= 5


def test_useless_drafts_fall_back_to_plain_and_keep_probing():
    ctrl = AdaptiveDepth(6, probe_every=8)
    chosen = drive(ctrl, 0.0, lambda n: 0.010 * n, 200)
    tail = chosen[50:]
    assert tail.count(0) > 0.8 * len(tail)  # plain decoding while speculation does not pay
    assert 0 < sum(d > 0 for d in tail) <= len(tail) / 6  # … but it still probes now and then
    assert ctrl.acceptance()[0] < 0.1


def test_depth_follows_acceptance_when_verify_cost_grows():
    """Linear verify cost: deep drafts pay only when acceptance is high."""
    cost = lambda n: 0.010 + 0.004 * n  # noqa: E731
    low = np.mean(drive(AdaptiveDepth(6), 0.4, cost, 300)[100:])
    high = np.mean(drive(AdaptiveDepth(6), 0.9, cost, 300)[100:])
    assert high > low + 1, (low, high)


def test_recovers_when_acceptance_returns():
    ctrl = AdaptiveDepth(6, probe_every=4)
    cost = lambda n: 0.010 * n  # noqa: E731 — drafts pay only when nearly all are accepted
    drive(ctrl, 0.0, cost, 100)
    later = drive(ctrl, 1.0, lambda n: 0.010 + 0.0001 * n, 100, seed=1)
    assert np.mean(later[-30:]) >= 5


@pytest.mark.parametrize("drafter,tree", [("ngram", None), ("draft", None), ("draft", "binary")])
def test_adaptive_output_equals_plain(tiny_bundle, drafter, tree):
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5]
    plain = Generator(tiny_bundle, max_seq_len=64).generate_ids(prompt, 40).token_ids
    res = Generator(tiny_bundle, drafter=drafter, tree=tree, max_seq_len=64, adaptive=True,
                    num_draft_tokens=4).generate_ids(prompt, 40)
    assert res.token_ids == plain
    st = res.stats.to_dict()
    assert 0 <= st["plain_steps"] <= st["steps"] and st["mean_draft_depth"] > 0


def _scripted_run(tiny_bundle, prompt: list[int], want: list[int], draft_seconds: float):
    """Adaptive generation of `want` after `prompt` on a fake clock: every draft is the target's own
    continuation (all accepted) and costs `draft_seconds`, every target pass VERIFY_S."""
    clock = FakeClock()
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, adaptive=True, num_draft_tokens=4, clock=clock)
    gen.target.run_all = paced(gen.target.run_all, clock, VERIFY_S)
    gen.drafter = ScriptedDrafter({tuple(prompt): Script(want, seconds=draft_seconds)}, clock)
    return gen.generate_ids(prompt, len(want))


def test_the_controller_decides_by_the_injected_clock(tiny_bundle):
    """The same drafts, all accepted, in both runs; only what the clock says a draft costs differs. Drafting
    free, deep drafts pay; drafting at 10 verify passes a draft, plain decoding commits more per second, so
    the controller goes plain (probing now and then). Timed by the machine's clock instead, both runs would
    measure the same drafter and choose alike; every stage's seconds are the script's."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 9, 12, 3, 4, 5]
    want = Generator(tiny_bundle, max_seq_len=64).generate_ids(prompt, 40).token_ids
    free, costly = (_scripted_run(tiny_bundle, prompt, want, s) for s in (0.0, 10 * VERIFY_S))
    assert free.token_ids == costly.token_ids == want
    deep, plain = free.stats, costly.stats
    assert deep.mean_draft_depth > 3 > 1 > plain.mean_draft_depth, (deep.to_dict(), plain.to_dict())
    assert deep.plain_steps <= 1  # at most one: the step that measures a one-row pass
    assert plain.plain_steps > 0.7 * plain.steps  # all but the first steps (full depth) and the probes
    for st, draft_seconds in ((deep, 0.0), (plain, 10 * VERIFY_S)):
        drafted = st.steps - st.plain_steps
        assert st.stage_seconds["propose"] == pytest.approx(drafted * draft_seconds)
        assert st.stage_seconds["verify"] == pytest.approx(st.steps * VERIFY_S)
        assert st.seconds == pytest.approx((1 + st.steps) * VERIFY_S + drafted * draft_seconds)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_adaptive_real_model_equals_plain_and_shows_its_choices(real_generator, drafter, monkeypatch):
    """On a fake clock (a pass costs VERIFY_S, drafting nothing) the controller's choices follow the
    acceptance alone, not how busy the machine is."""
    gen = real_generator
    ids = gen.tokenizer.encode_prompt("List the numbers from 1 to 30, separated by commas, then say done.")
    plain = gen.use("plain").generate_ids(ids, 96).token_ids
    clock = FakeClock()
    monkeypatch.setattr(gen, "clock", clock)
    monkeypatch.setattr(gen.target, "run_all", paced(gen.target.run_all, clock, VERIFY_S))
    gen.configure(6, None, adaptive=True)
    try:
        res = gen.use(drafter).generate_ids(ids, 96)
    finally:
        gen.configure()
    assert res.token_ids == plain
    st = res.stats
    assert st.steps < len(plain) and 0 < st.mean_draft_depth <= 6
