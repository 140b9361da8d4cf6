"""Adaptive draft depth: the controller's choices follow acceptance and cost; output never changes."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.adaptive import AdaptiveDepth
from specrt.runtime.generate import Generator


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


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_adaptive_real_model_equals_plain_and_shows_its_choices(real_generator, drafter):
    gen = real_generator
    ids = gen.tokenizer.encode_prompt("List the numbers from 1 to 30, separated by commas, then say done.")
    plain = gen.use("plain").generate_ids(ids, 96).token_ids
    gen.configure(6, None, adaptive=True)
    try:
        res = gen.use(drafter).generate_ids(ids, 96)
    finally:
        gen.configure()
    assert res.token_ids == plain
    st = res.stats
    assert st.steps < len(plain) and 0 < st.mean_draft_depth <= 6
