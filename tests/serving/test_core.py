"""The scheduler's step as data (serving/core.py), driven plan by apply with scripted outputs: no thread,
no clock, no target pass. Each test scripts the token every row's logits pick, so what the core does with
them (admission, chunk order, batching, delivery, ends) is the only thing under test."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.batch import BatchOutputs
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.serving.core import Delivered, Ended, PassOutput, SchedulerCore
from specrt.serving.handle import Handle


@pytest.fixture()
def core(tiny_bundle):
    return SchedulerCore(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=3), 3)


@pytest.fixture()
def core4(tiny_bundle):
    """A core whose steps run prompts in chunks of 4 rows (the tiny model's context is 64)."""
    return SchedulerCore(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=3), 3, prefill_chunk=4)


def request(prompt: list[int], max_new_tokens: int) -> Handle:
    return Handle(prompt, max_new_tokens, SamplingParams(), None)


def outputs(core: SchedulerCore, plan, token: dict[int, int]) -> list[PassOutput]:
    """Each pass's logits picking `token[slot]` at every row of that slot (0 where none is scripted)."""
    vocab = core.gen.manifest.target.config.vocab_size
    outs = []
    for bp in plan.passes:
        rows = max(len(w.rows) for w in bp.windows if w is not None)
        logits = np.zeros((len(bp.windows), rows, vocab), np.float32)
        for i in range(len(bp.windows)):
            logits[i, :, token.get(bp.start + i, 0)] = 1.0
        outs.append(PassOutput(BatchOutputs({"logits": logits}), seconds=0.01))
    return outs


def delivered(events) -> dict:
    return {e.handle: e.tokens for e in events if isinstance(e, Delivered)}


def test_prompts_prefill_oldest_first_and_decode_from_the_next_step(core):
    a, b = request([5, 6, 7], 4), request([8, 9], 4)
    plan = core.plan([a, b])
    assert core.running == 2 and plan.events == []
    assert [(bp.kind, bp.slots, bp.final) for bp in plan.passes] == [("prefill", [0], True)]  # one chunk a step
    assert delivered(core.apply(plan, outputs(core, plan, {0: 11}))) == {a: [11]}

    plan = core.plan()  # b's prompt, and a's first decode row
    assert [(bp.kind, bp.slots) for bp in plan.passes] == [("prefill", [1]), ("decode", [0])]
    window = plan.passes[1].windows[0]
    assert window.window.tolist() == [11] and window.past == 3  # the first token's row, after the prompt
    assert delivered(core.apply(plan, outputs(core, plan, {0: 12, 1: 21}))) == {b: [21], a: [12]}

    plan = core.plan()  # both decode: one pass over slots 0..1, a plain row each
    assert [(bp.kind, bp.slots, bp.start, bp.stop) for bp in plan.passes] == [("decode", [0, 1], 0, 2)]
    assert delivered(core.apply(plan, outputs(core, plan, {0: 13, 1: 22}))) == {a: [13], b: [22]}
    assert list(core.batch_sizes) == [1, 2]


def test_where_passes_are_ragged_a_prompt_chunk_rides_in_the_decode_pass(tiny_bundle):
    core = SchedulerCore(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=3), 3, mix_chunks=True,
                         prefill_chunk=4)
    a, b = request([5, 6, 7], 8), request(list(range(30, 39)), 4)
    plan = core.plan([a])
    core.apply(plan, outputs(core, plan, {0: 11}))
    plan = core.plan([b])  # b's first chunk beside a's decode row: one pass over slots 0..1
    assert [(bp.kind, bp.slots, bp.chunk, bp.final) for bp in plan.passes] == [("decode", [0, 1], 1, False)]
    assert len(plan.passes[0].windows[1].window) == 4 and plan.passes[0].windows[1].rows.tolist() == [3]
    assert delivered(core.apply(plan, outputs(core, plan, {0: 12, 1: 21}))) == {a: [12]}
    plan = core.plan()  # its second chunk, then its last (one row): each beside a's row
    assert [(bp.slots, bp.chunk, bp.final) for bp in plan.passes] == [([0, 1], 1, False)]
    core.apply(plan, outputs(core, plan, {0: 13, 1: 21}))
    plan = core.plan()
    assert [(bp.slots, bp.chunk, bp.final) for bp in plan.passes] == [([0, 1], 1, True)]
    assert delivered(core.apply(plan, outputs(core, plan, {0: 14, 1: 22}))) == {a: [14], b: [22]}
    plan = core.plan()  # both decode
    assert [(bp.kind, bp.slots, bp.chunk) for bp in plan.passes] == [("decode", [0, 1], None)]
    assert list(core.batch_sizes) == [1, 1, 1] and core.costs.seconds == {}  # mixed passes price nothing


def test_a_request_ends_with_its_scripted_tokens_and_frees_its_slot(core):
    a = request([5, 6, 7], 3)
    events = []
    plan = core.plan([a])
    for token in (11, 12, 13):
        events += core.apply(plan, outputs(core, plan, {0: token}))
        plan = core.plan()
    ended = [e for e in events if isinstance(e, Ended)]
    assert len(ended) == 1 and ended[0].handle is a and ended[0].reason == "length"
    assert ended[0].result.token_ids == [11, 12, 13] and core.running == 0 and plan.passes == []


def test_a_long_prompt_takes_one_chunk_a_step_while_the_others_decode(core4):
    core = core4
    a, b, c = request([5, 6], 20), request(list(range(30, 41)), 2), request([7, 8], 20)
    plan = core.plan([a, b, c])
    steps = []
    while any(bp.kind == "prefill" and bp.slots == [1] for bp in plan.passes) or not steps:
        steps.append([(bp.kind, bp.slots) for bp in plan.passes])
        core.apply(plan, outputs(core, plan, {0: 11, 1: 12, 2: 13}))
        plan = core.plan()
    # b's 11 rows: 3 chunks of 4, one a step; a decodes in every step after its own prompt
    assert steps[0] == [("prefill", [0])]
    assert steps[1] == [("prefill", [1]), ("decode", [0])]
    assert [s[0] for s in steps[2:]] == [("prefill", [1])] * 2


def test_a_slot_between_chunks_gets_a_dummy_row_where_its_next_chunk_starts(core4):
    core = core4
    a, x, c = (request([5, 6], 20) for _ in range(3))
    plan = core.plan([a, x, c])
    for _ in range(3):  # a prompt a step: all three decode from the fourth
        core.apply(plan, outputs(core, plan, {}))
        plan = core.plan()
    x.cancel()
    b = request(list(range(30, 41)), 2)
    core.apply(plan, outputs(core, plan, {}))
    plan = core.plan([b])  # x's slot goes to b: its first chunk, and a decode pass over slots 0..2
    assert [(bp.kind, bp.slots, bp.start, bp.stop) for bp in plan.passes] == [
        ("prefill", [1], 1, 2), ("decode", [0, 2], 0, 3)]
    dummy = plan.passes[1].windows[1]
    assert dummy.past == 4 and len(dummy.window) == 1  # after the chunk (rows 0..3) this step writes
    core.apply(plan, outputs(core, plan, {}))
    plan = core.plan()
    assert plan.passes[1].windows[1].past == 8


def test_a_failed_pass_ends_only_its_own_requests(core):
    a, b, c = request([5, 6, 7], 8), request([8, 9], 8), request([4, 4], 8)
    plan = core.plan([a, b])
    for _ in range(2):  # both prompts in: both decode
        core.apply(plan, outputs(core, plan, {0: 11, 1: 21}))
        plan = core.plan()
    core.apply(plan, outputs(core, plan, {0: 11, 1: 21}))
    plan = core.plan([c])  # c's prompt, then the decode pass over a and b, which fails
    assert [(bp.kind, bp.slots) for bp in plan.passes] == [("prefill", [2]), ("decode", [0, 1])]
    results = outputs(core, plan, {2: 31})
    results[1] = PassOutput(None, 0.0, RuntimeError("engine"))
    events = core.apply(plan, results)
    assert [(e.handle, e.tokens) for e in events if isinstance(e, Delivered)] == [(c, [31])]
    assert [(e.handle, str(e.error)) for e in events if isinstance(e, Ended)] == [(a, "engine"), (b, "engine")]
    assert core.running == 1 and core.slots[2].handle is c


def test_cancelled_requests_end_before_the_passes_and_free_room(core):
    a, b, c = (request([5, 6], 8) for _ in range(3))
    plan = core.plan([a, b, c])
    core.apply(plan, outputs(core, plan, {}))
    assert core.room == 0
    b.cancel()
    assert core.room == 1  # the next plan frees b's slot before it admits
    d = request([9, 9], 4)
    plan = core.plan([d])
    assert [(e.handle, e.reason) for e in plan.events] == [(b, "cancelled")]
    assert core.slots[1].handle is d
    assert all(1 not in bp.slots or bp.kind == "prefill" for bp in plan.passes)


def test_a_request_cancelled_before_admission_never_takes_a_slot(core):
    a = request([5, 6], 8)
    a.cancel()
    plan = core.plan([a])
    assert [(e.handle, e.reason, e.result) for e in plan.events] == [(a, "cancelled", None)]
    assert core.running == 0 and plan.passes == []


@pytest.mark.parametrize("chunk, sizes", [(4, [4, 4, 3]), (6, [6, 5]), (11, [11]), (64, [11])])
def test_the_prefill_chunk_sets_the_rows_each_step_runs_of_a_prompt(tiny_bundle, chunk, sizes):
    core = SchedulerCore(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=3), 3, prefill_chunk=chunk)
    b = request(list(range(30, 41)), 2)  # 11 prompt rows
    plan, ran = core.plan([b]), []
    while plan.passes and plan.passes[0].kind == "prefill":
        ran.append(len(plan.passes[0].windows[0].window))
        core.apply(plan, outputs(core, plan, {0: 7}))
        plan = core.plan()
    assert ran == sizes
    assert plan.passes[0].kind == "decode"  # its first token came with the last chunk


def test_a_prefill_chunk_of_no_rows_is_refused(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    with pytest.raises(SpecrtError, match=r"--prefill-chunk 0: a step runs at least one prompt row"):
        SchedulerCore(gen, 1, prefill_chunk=0)
