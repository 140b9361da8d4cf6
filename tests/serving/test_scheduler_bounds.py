"""The scheduler's bounds: a long prompt prefills a chunk per step between the others' decode steps, and
the waiting queue's bound holds under a burst."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime import sequence
from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler, SchedulerFull

PROMPT = "The list of colors: red, green, blue, red, green, blue, red, green, blue, red, green, blue, red"


def _traced(gen, log: list) -> callable:
    """A scheduler's runner recording every pass as (kind, slots it commits, the range of slots it spans)."""
    def run(bp):
        log.append((bp.kind, tuple(bp.slots), range(bp.start, bp.stop)))
        return gen.model.run_batch(bp.windows, bp.start)

    return run


def _drain(scheduler) -> None:
    while scheduler.running or scheduler.waiting:
        scheduler.step()


def test_a_long_prompt_interleaves_with_decoding_and_stays_exact(tiny_bundle, tiny_reference):
    gen, log = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2), []
    # the tiny model's context is 64: 8-row chunks
    scheduler = Scheduler(gen, max_waiting=4, runner=_traced(gen, log), prefill_chunk=8)
    short = gen.tokenizer.encode_prompt("red, green,", raw=True)
    long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
    assert len(short) <= 8 < 3 * 8 < len(long)
    a = scheduler.submit(short, 40)
    scheduler.step()  # a's prompt (one chunk): a decodes from the next step
    b = scheduler.submit(long, 8)
    _drain(scheduler)
    chunks = [i for i, (kind, slots, _) in enumerate(log) if kind == "prefill" and slots == (1,)]
    assert len(chunks) == -(-len(long) // 8)
    # each step ran one chunk of b and a decode pass of a: b delayed a by one chunk per step
    assert all(log[i + 1][:2] == ("decode", (0,)) for i in chunks)
    assert a.wait().token_ids == tiny_reference.generate_ids(short, 40).token_ids
    assert b.wait().token_ids == tiny_reference.generate_ids(long, 8).token_ids


def test_a_slot_prefilling_between_decoding_slots_keeps_its_cache(tiny_bundle, tiny_reference):
    """Slots 0 and 2 decode while slot 1 prefills chunk by chunk: the batched decode passes span slot 1
    and must not write into the rows its earlier chunks filled."""
    gen, log = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=3), []
    scheduler = Scheduler(gen, max_waiting=4, runner=_traced(gen, log), prefill_chunk=8)
    short = gen.tokenizer.encode_prompt("red, green,", raw=True)
    long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
    a, x, c = (scheduler.submit(short, 45) for _ in range(3))  # slots 0, 1, 2
    for _ in range(3):  # one prompt chunk a step: all three decode from the fourth
        scheduler.step()
    assert [s.handle for s in scheduler.slots] == [a, x, c] and all(s.decoding for s in scheduler.slots)
    x.cancel()
    b = scheduler.submit(long, 8)  # slot 1 again, once x is gone
    kv = None  # slot 1's cache as b ends (afterwards it is a free slot again)
    while kv is None:
        if any(getattr(e, "result", None) is not None and e.handle is b for e in scheduler.step()):
            kv = [buf[1].copy() for buf in gen.target.kv]
    _drain(scheduler)
    assert x.wait().finish_reason == "cancelled"
    chunks = [i for i, (kind, slots, _) in enumerate(log) if kind == "prefill" and slots == (1,)]
    assert len(chunks) > 2
    spanning = [span for kind, _, span in log[chunks[0] : chunks[-1]] if kind == "decode" and 1 in span]
    assert len(spanning) >= len(chunks) - 1  # decode passes spanned slot 1 while it prefilled
    assert a.wait().token_ids == tiny_reference.generate_ids(short, 45).token_ids
    assert b.wait().token_ids == tiny_reference.generate_ids(long, 8).token_ids
    c.wait()
    n = len(long)  # slot 1's prompt rows equal a lone prefill's (the reference's slot 0), bitwise
    for got, want in zip(kv, tiny_reference.target.kv, strict=True):
        np.testing.assert_array_equal(got[:, :n], want[0, :, :n])


def test_max_waiting_holds_under_a_burst(tiny_bundle):
    """A request counts against the bound from its submission to its end, queued or holding a slot."""
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=2)
    ids = gen.tokenizer.encode_prompt("red, green,", raw=True)

    def burst(n: int) -> list:
        accepted = []
        for _ in range(n):
            try:
                accepted.append(scheduler.submit(ids, 20))
            except SchedulerFull:
                pass
        return accepted

    accepted = burst(30)
    assert len(accepted) == 1 + 2 and scheduler.metrics.rejected._value.get() == 27  # one slot + two waiting
    scheduler.step()  # the first leaves the queue for the slot: it still counts
    assert scheduler.running == 1 and len(scheduler.waiting) == 2 and burst(5) == []
    accepted[0].cancel()
    scheduler.step()  # it ended: one more fits
    assert accepted[0].wait().finish_reason == "cancelled" and len(burst(5)) == 1
    for h in scheduler.waiting:
        h.cancel()
    scheduler.stop()
    assert scheduler.metrics.rejected._value.get() == 27 + 5 + 4


def test_cancelled_while_prefilling_frees_the_slot(tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=1, prefill_chunk=4)
    long = gen.tokenizer.encode_prompt(PROMPT, raw=True)
    h = scheduler.submit(long, 8)
    scheduler.step()
    assert scheduler.slots[0].prefill  # mid-prompt: more chunks to come
    h.cancel()
    scheduler.step()
    assert h.wait().finish_reason == "cancelled" and h.result.token_ids == []
    assert scheduler.running == 0
    short = gen.tokenizer.encode_prompt("red, green,", raw=True)
    done = scheduler.submit(short, 6)
    _drain(scheduler)
    assert done.wait().token_ids == tiny_reference.generate_ids(short, 6).token_ids


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


def test_on_native_a_prompt_chunk_rides_in_the_decode_pass_and_stays_exact(trained_int4_bundle):
    """Ragged passes (native): a long prompt's chunks run inside the decoding stream's passes, not as passes
    of their own, and both texts equal single-request plain decoding."""
    bundle = trained_int4_bundle
    gen, log = Generator(bundle, drafter="plain", max_seq_len=512, slots=2, backend="native"), []
    scheduler = Scheduler(gen, runner=_traced(gen, log))
    assert scheduler.core.mix_chunks
    short = gen.tokenizer.encode_prompt("Name three colors.")
    long = gen.tokenizer.encode_prompt(" ".join([PROMPT] * 6))
    assert len(long) > 2 * sequence.PREFILL_CHUNK
    a = scheduler.submit(short, 40)
    scheduler.step()
    b = scheduler.submit(long, 8)
    _drain(scheduler)
    mixed = [slots for kind, slots, _ in log if kind == "decode" and slots == (0, 1)]
    assert len(mixed) >= -(-len(long) // sequence.PREFILL_CHUNK)  # every chunk of b rode beside a's row
    assert not [kind for kind, _, _ in log[1:] if kind == "prefill"]  # none ran alone once a decoded
    alone = Generator(bundle, drafter="plain", max_seq_len=512, backend="native")
    assert a.wait().token_ids == alone.generate_ids(short, 40).token_ids
    assert b.wait().token_ids == alone.generate_ids(long, 8).token_ids
