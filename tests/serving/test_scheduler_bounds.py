"""The scheduler's bounds: a long prompt prefills a chunk per step between the others' decode steps, and
the waiting queue's bound holds under a burst."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specrt.runtime import sequence
from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler, SchedulerFull
from tests.serving.conftest import HOLD_S, Gate

PROMPT = "The list of colors: red, green, blue, red, green, blue, red, green, blue, red, green, blue, red"


def _trace_passes(scheduler) -> list[tuple[str, tuple[int, ...], range]]:
    """Record every target pass as ("prefill", (slot,), its range) or ("decode", slots with a plan or a
    placeholder, the range of slots the pass spans)."""
    log = []
    one, step = scheduler._prefill_chunk, scheduler._pass

    def traced_pass(plans, lo, hi):
        kind = "prefill" if tracing["prefill"] else "decode"
        log.append((kind, tuple(b for b, p in zip(range(lo, hi), plans, strict=True) if p is not None), range(lo, hi)))
        return step(plans, lo, hi)

    def traced_chunk():
        tracing["prefill"] = True
        try:
            one()
        finally:
            tracing["prefill"] = False

    tracing = {"prefill": False}
    scheduler._pass, scheduler._prefill_chunk = traced_pass, traced_chunk
    return log


def test_a_long_prompt_interleaves_with_decoding_and_stays_exact(tiny_bundle, tiny_reference, monkeypatch):
    monkeypatch.setattr(sequence, "PREFILL_CHUNK", 8)  # the tiny model's context is 64: 8-row chunks
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2)
    scheduler = Scheduler(gen, max_waiting=4)
    log = _trace_passes(scheduler)
    short = gen.tokenizer.encode_prompt("red, green,", raw=True)
    long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
    assert len(short) <= 8 < 3 * 8 < len(long)
    gate = Gate(scheduler, closed=True)
    gate.allow(1)  # a's prompt (one chunk); its first decode pass waits until b is queued
    scheduler.start()
    try:
        a = scheduler.submit(short, 40)
        next(iter(a))  # a is decoding
        b = scheduler.submit(long, 8)
        gate.open()
        got_a, got_b = a.wait().token_ids, b.wait().token_ids
    finally:
        scheduler.stop()
    chunks = [i for i, (kind, slots, _) in enumerate(log) if kind == "prefill" and slots == (1,)]
    assert len(chunks) == -(-len(long) // 8)
    between = log[chunks[0] : chunks[-1]]
    # between b's first and last chunk, a decoded after every chunk: b delayed it by one chunk per step
    assert sum(kind == "decode" for kind, _, _ in between) >= len(chunks) - 1
    assert all(log[i + 1][0] == "decode" for i in chunks[:-1])
    assert got_a == tiny_reference.generate_ids(short, 40).token_ids
    assert got_b == tiny_reference.generate_ids(long, 8).token_ids


def test_a_slot_prefilling_between_decoding_slots_keeps_its_cache(tiny_bundle, tiny_reference, monkeypatch):
    """Slots 0 and 2 decode while slot 1 prefills chunk by chunk: the batched decode passes span slot 1
    and must not write into the rows its earlier chunks filled."""
    monkeypatch.setattr(sequence, "PREFILL_CHUNK", 8)
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=3)
    scheduler = Scheduler(gen, max_waiting=4)
    log = _trace_passes(scheduler)
    finished_kv = {}  # slot 1's cache as its sequence finishes (afterwards it is a free slot again)
    release = scheduler._release

    def snapshot(slot):
        if slot.index == 1:
            finished_kv[slot.handle] = [buf[1].copy() for buf in gen.target.kv]
        release(slot)

    scheduler._release = snapshot
    short = gen.tokenizer.encode_prompt("red, green,", raw=True)
    long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
    a, x, c = (scheduler.submit(short, 45) for _ in range(3))  # slots 0, 1, 2
    gate = Gate(scheduler, closed=True)
    # a, x, c each: its prompt's one chunk, then a decode step (one pass: a batch size not measured yet runs
    # batched, pass_policy.py); the 7th pass waits, the first with all three decoding
    gate.allow(6)
    scheduler.start()
    try:
        assert gate.wait_started(7)
        assert [s.handle for s in scheduler.slots] == [a, x, c] and all(s.decoding for s in scheduler.slots)
        x.cancel()
        b = scheduler.submit(long, 8)  # slot 1 again, once x is gone
        gate.open()
        x.wait()
        got_b, got_a = b.wait().token_ids, a.wait().token_ids
        c.wait()
    finally:
        scheduler.stop()
    chunks = [i for i, (kind, slots, _) in enumerate(log) if kind == "prefill" and slots == (1,)]
    assert len(chunks) > 2
    spanning = [span for kind, _, span in log[chunks[0] : chunks[-1]] if kind == "decode" and 1 in span]
    assert len(spanning) >= len(chunks) - 1  # decode passes spanned slot 1 while it prefilled
    assert got_a == tiny_reference.generate_ids(short, 45).token_ids
    assert got_b == tiny_reference.generate_ids(long, 8).token_ids
    n = len(long)  # slot 1's prompt rows equal a lone prefill's (the reference's slot 0), bitwise
    for got, want in zip(finished_kv[b], tiny_reference.target.kv, strict=True):
        np.testing.assert_array_equal(got[:, :n], want[0, :, :n])


def test_max_waiting_holds_under_a_burst(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=2)
    make, admitting, admit = gen.sequence, threading.Event(), threading.Event()

    def held_admission(*args, **kwargs):  # the first request holds the moment between the queue and the slot
        admitting.set()
        assert admit.wait(HOLD_S)
        return make(*args, **kwargs)

    gen.sequence = held_admission
    scheduler.start()
    try:
        ids = gen.tokenizer.encode_prompt("red, green,", raw=True)
        accepted, refused = [scheduler.submit(ids, 20)], 0
        assert admitting.wait(HOLD_S)  # it left the queue and claimed the only slot: the burst comes now
        for _ in range(29):
            try:
                accepted.append(scheduler.submit(ids, 20))
            except SchedulerFull:
                refused += 1
        assert len(accepted) == 1 + 2 and refused == 27  # one slot + two waiting
        assert scheduler.metrics.rejected._value.get() == 27
        for h in accepted:
            h.cancel()
    finally:
        admit.set()
        scheduler.stop()


def test_cancelled_while_prefilling_frees_the_slot(tiny_bundle, tiny_reference, monkeypatch):
    monkeypatch.setattr(sequence, "PREFILL_CHUNK", 4)
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=1)
    gate = Gate(scheduler, closed=True)
    gate.allow(1)  # the prompt's first chunk; its second waits at the gate
    scheduler.start()
    try:
        long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
        h = scheduler.submit(long, 8)
        assert gate.wait_started(2) and scheduler.slots[0].prefill  # mid-prompt: more chunks to come
        h.cancel()
        gate.open()
        assert h.wait().finish_reason == "cancelled" and h.result.token_ids == []
        short = gen.tokenizer.encode_prompt("red, green,", raw=True)
        assert scheduler.submit(short, 6).wait().token_ids == tiny_reference.generate_ids(short, 6).token_ids
    finally:
        scheduler.stop()


@pytest.mark.parametrize("bias", [100.0, -100.0])
def test_logit_bias_is_exact_under_speculation(tiny_bundle, tiny_reference, bias):
    """A biased request decodes with ngram drafts exactly as plain decoding with the same bias."""
    ids = tiny_reference.tokenizer.encode_prompt("red, green, blue, red, green,", raw=True)
    plain = tiny_reference.generate_ids(ids, 12).token_ids
    target = plain[0]
    seq = tiny_reference.sequence(ids, 12, logit_bias={target: bias})
    out = seq.prefill(tiny_reference.run_pass)
    while (new := seq.step(tiny_reference.run_pass)) is not None:
        out += new
    scheduler = Scheduler(Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2)).start()
    try:
        served = scheduler.submit(ids, 12, options={"logit_bias": {target: bias}}).wait().token_ids
    finally:
        scheduler.stop()
    assert served == out
    if bias > 0:
        assert set(out) == {target}
    else:
        assert target not in out and out != plain
