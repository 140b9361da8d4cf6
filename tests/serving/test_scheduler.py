"""The continuous-batching scheduler: batched verify passes give each sequence what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.serving.scheduler import Scheduler, SchedulerFull
from specrt.runtime.tree import Tree

PROMPTS = ["Say hi.", "List three colors, then list them again.", "What is 2+2?", "Write a haiku about rain.",
           "Explain what a cat is.", "Count from 1 to 10."]


def _pass_logits(gen: Generator, scheduler: Scheduler, prompts: list[list[int]]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Prefill each prompt alone in its slot, then one batched 3-token chain pass over all slots vs the
    same pass per slot alone; returns (batched logits, single logits)."""
    from specrt.runtime.sequence import Pass

    plans = []
    for b, ids in enumerate(prompts):
        n = len(ids)
        scheduler._pass([Pass(np.asarray(ids, np.int64), 0, Tree.chain(n - 1), np.array([n - 1]))], b, b + 1)
        plans.append(Pass(np.asarray([ids[-1], 11, 12][: 1 + b % 3], np.int64), n - 1, Tree.chain(b % 3),
                          np.arange(1 + b % 3)))
    batched = scheduler._pass(plans, 0, len(plans))["logits"].copy()
    single = [scheduler._pass([p], b, b + 1)["logits"][0].copy() for b, p in enumerate(plans)]
    return batched, single


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_batched_pass_equals_single_passes(which, tiny_bundle, real_bundle):
    """Batch invariance: rows of a ragged batched pass (different past_len, window lengths, padding)
    equal the same rows computed one sequence at a time, bit for bit."""
    bundle = tiny_bundle if which == "tiny" else real_bundle
    gen = Generator(bundle, drafter="plain", max_seq_len=64 if which == "tiny" else 256, slots=3)
    scheduler = Scheduler(gen)
    prompts = [gen.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    batched, single = _pass_logits(gen, scheduler, prompts)
    for b, s in enumerate(single):
        m = s.shape[0]
        assert np.array_equal(batched[b, :m], s), (b, float(np.abs(batched[b, :m] - s).max()))


@pytest.mark.parametrize("drafter", ["plain", "ngram", "draft"])
def test_served_greedy_equals_single_request_plain(drafter, tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter=drafter, max_seq_len=64, slots=4)
    scheduler = Scheduler(gen).start()
    try:
        ids = [gen.tokenizer.encode_prompt(p, raw=True) for p in PROMPTS]
        handles = [scheduler.submit(x, 8 + 3 * i) for i, x in enumerate(ids)]  # 6 requests, 4 slots: admission
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    for i, (x, r) in enumerate(zip(ids, results, strict=True)):
        assert r.token_ids == tiny_reference.generate_ids(x, 8 + 3 * i).token_ids, i
    assert max(scheduler.batch_sizes) > 1  # verify passes really were shared
    assert min(scheduler.batch_sizes) >= 1


@pytest.mark.slow
def test_served_greedy_equals_single_request_on_real_model(real_bundle, real_generator):
    gen = Generator(real_bundle, drafter="ngram", max_seq_len=256, slots=4)
    scheduler = Scheduler(gen).start()
    try:
        ids = [gen.tokenizer.encode_prompt(p) for p in PROMPTS[:4]]
        results = [h.wait() for h in [scheduler.submit(x, 24) for x in ids]]
    finally:
        scheduler.stop()
    real_generator.use("plain")
    for x, r in zip(ids, results, strict=True):
        assert r.token_ids == real_generator.generate_ids(x, 24).token_ids
    assert sum(r.stats.accepted for r in results) > 0  # speculation was active


def test_seeded_sampling_is_the_same_batched_or_alone(tiny_bundle):
    """A seeded sampled request draws the same tokens whether it shares passes or runs alone."""
    sampling = [SamplingParams(temperature=0.9, top_p=0.95, seed=s) for s in range(4)]
    alone = Generator(tiny_bundle, drafter="ngram", max_seq_len=64)
    ids = alone.tokenizer.encode_prompt(PROMPTS[1], raw=True)
    want = [alone.generate_ids(ids, 16, sp).token_ids for sp in sampling]
    scheduler = Scheduler(Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=4)).start()
    try:
        got = [h.wait().token_ids for h in [scheduler.submit(ids, 16, sp) for sp in sampling]]
    finally:
        scheduler.stop()
    assert got == want
    assert len({tuple(t) for t in got}) > 1  # different seeds really differ


def test_cancel_frees_the_slot_and_full_engine_refuses(tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=1).start()
    try:
        ids = gen.tokenizer.encode_prompt(PROMPTS[0], raw=True)
        long = scheduler.submit(ids, 60 - len(ids))
        next(iter(long))  # admitted: it holds the only slot
        with scheduler._lock:  # the scheduler waits at the top of its next iteration
            assert long.result is None and scheduler.running == 1
            waiting = scheduler.submit(ids, 5)  # queued
            with pytest.raises(SchedulerFull, match="retry later"):
                scheduler.submit(ids, 5)
            long.cancel()
        r = long.wait()
        assert r.finish_reason == "cancelled" and len(r.token_ids) < 60 - len(ids)
        assert waiting.wait().token_ids == tiny_reference.generate_ids(ids, 5).token_ids
        assert scheduler.running == 0
    finally:
        scheduler.stop()


def test_too_long_prompt_is_refused_at_submit(tiny_bundle):
    scheduler = Scheduler(Generator(tiny_bundle, drafter="plain", max_seq_len=16, slots=2))
    with pytest.raises(Exception, match="KV capacity is 16"):
        scheduler.submit(list(range(1, 17)), 4)


def test_iter_text_streams_the_generated_text_and_returns_stats(tiny_reference):
    ids = tiny_reference.tokenizer.encode_prompt(PROMPTS[1])
    want = tiny_reference.generate_ids(ids, 20)
    stream = tiny_reference.iter_text(PROMPTS[1], max_new_tokens=20)
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == tiny_reference.tokenizer.decode(want.token_ids)
    assert stream.result.token_ids == want.token_ids and stream.result.text == "".join(pieces)
    assert stream.result.stats.new_tokens == len(want.token_ids)
