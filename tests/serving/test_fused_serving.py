"""Serving on a backend that batches one row per sequence (`ort-fused`): the two plans, the verdicts
that decide what may batch, and served output held to single-request decoding in the served mode."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.registry import BACKENDS
from specrt.runtime.exactness import judge
from specrt.runtime.exec_modes import ShapedDecoder, exec_mode
from specrt.runtime.generate import Generator
from specrt.serving import pass_policy
from specrt.serving.scheduler import Scheduler
from tests.helpers import built_copy

PROMPTS = ["Say hi. Say hi. Say hi.", "List three colors, then list them again.", "What is 2+2? 2+2 is",
           "Count from 1 to 10: 1, 2, 3,", "Write a haiku about rain.", "a b c a b c a b"]
CAPACITY = 64


@pytest.fixture(scope="module")
def fused_bundle(tiny_bundle, tmp_path_factory):
    return built_copy(tiny_bundle, tmp_path_factory.mktemp("fused-serving") / "bundle")


def _record(direct: dict, pad2: dict) -> dict:
    full = {"chain": 0.0, "tree": None, "batch": 0.0, "kv": 0.0, "chain_kv": 0.0, "batch_kv": 0.0}
    measured = {}
    for name, m in (("direct", direct), ("pad2", pad2)):
        measured[name] = {**full, **m}
        measured[name]["invariant"] = all(measured[name][c] in (None, 0.0) for c in ("chain", "tree", "batch", "kv"))
    chosen = next((n for n, m in measured.items() if m["invariant"]), None)
    return {"chosen": chosen, "measured": measured,
            "fingerprint": {"cpu": "test cpu", "features": [], "onnxruntime": "0", "threads": 1, "backend": "ort-fused"}}


def test_the_fused_backend_batches_single_rows_not_windows():
    entry = BACKENDS["ort-fused"]
    assert entry.batch_windows is False and entry.max_batch > 1 and entry.trees is False
    assert BACKENDS["ort"].batch_windows is True


def test_a_batched_caller_takes_the_mode_that_batches_plain_decoding():
    """Single-row attention computed otherwise than multi-row attention (GroupQueryAttention here):
    direct batches plain decoding exactly but not drafts; pad2 verifies drafts exactly at batch 1 only."""
    record = _record(direct={"chain": 0.8, "chain_kv": 0.6, "kv": 0.6},
                     pad2={"batch": 0.7, "batch_kv": 0.9, "kv": 0.9})
    served = judge(record, "auto", "test", batched=True)
    assert (served.mode.name, served.lossless, served.plain_batches) == ("direct", False, True)
    assert "batches plain decoding exactly" in served.reason
    alone = judge(record, "auto", "test", batched=False)
    assert (alone.mode.name, alone.lossless, alone.plain_batches) == ("pad2", True, False)
    forced = judge(record, "pad2", "test", batched=True)  # a forced mode is judged as asked
    assert not forced.lossless and not forced.plain_batches


def test_a_fully_invariant_mode_serves_drafts_and_batches():
    record = _record(direct={"chain": 0.8, "kv": 0.6, "chain_kv": 0.6}, pad2={})
    for batched in (True, False):
        found = judge(record, "auto", "test", batched=batched)
        assert (found.mode.name, found.lossless, found.plain_batches) == ("pad2", True, True)


class _Recorder:
    def __init__(self):
        self.shapes = []

    def run_all(self, input_ids, position_ids, past_len, tree_mask, logits_index, **extra):
        self.shapes.append(input_ids.shape)
        b, t = input_ids.shape
        return {"logits": np.zeros((b, logits_index.shape[1], 3), np.float32),
                "hidden_states": np.zeros((b, t, 2), np.float32)}


def _pass(b: int, t: int):
    return (np.zeros((b, t), np.int64), np.zeros((b, t), np.int64), np.zeros(b, np.int64),
            np.broadcast_to(np.eye(t, dtype=bool), (b, t, t)).copy(), np.tile(np.arange(t), (b, 1)))


@pytest.mark.parametrize(("mode", "batch", "rows", "padded_rows"), [
    ("pad2", 1, 1, 2), ("pad2", 2, 1, 1), ("pad2", 16, 1, 1), ("pad2", 1, 3, 3),
    ("pad4", 2, 1, 2), ("pad4", 4, 1, 1), ("pad4", 3, 1, 2)])
def test_padding_counts_the_rows_of_every_sequence(mode, batch, rows, padded_rows):
    """The kernels' M is batch × rows: a batch of single rows is already past pad2's two rows."""
    inner = _Recorder()
    outs = ShapedDecoder(inner, exec_mode(mode)).run_all(*_pass(batch, rows))
    assert inner.shapes == [(batch, padded_rows)]
    assert outs["logits"].shape[:2] == (batch, rows) and outs["hidden_states"].shape[:2] == (batch, rows)


def test_the_policy_explores_then_takes_the_faster_plan():
    costs, yields = pass_policy.PassCosts(), pass_policy.Yield(prior=3.0)
    slots, windows = [0, 1, 2, 3], {s: 5 for s in range(4)}
    assert pass_policy.choose(slots, 4, windows, costs, yields) == "batched"  # c(4, 1) unknown
    costs.observe(4, 1, 0.020)
    assert pass_policy.choose(slots, 4, windows, costs, yields) == "drafted"  # c(1, 5) unknown
    costs.observe(1, 5, 0.012)
    # drafted: 4 × 3 tokens / (4 × 12 ms) = 250 tok/s; batched: 4 tokens / 20 ms = 200 tok/s
    assert pass_policy.choose(slots, 4, windows, costs, yields) == "drafted"
    for s in slots:  # the drafts stop paying: one token per drafted pass
        for _ in range(30):
            yields.observe(s, 1)
    assert pass_policy.choose(slots, 4, windows, costs, yields) == "batched"


def test_pass_costs_smooth_and_scale_to_unmeasured_rows():
    costs = pass_policy.PassCosts()
    costs.observe(1, 2, 0.010)
    costs.observe(1, 2, 0.020)
    assert costs.get(1, 2) == pytest.approx(0.012)
    assert costs.get(1, 4) == pytest.approx(0.024)  # more rows than measured: in proportion
    assert costs.get(1, 1) == pytest.approx(0.012)  # fewer: no cheaper than the nearest measured
    assert costs.get(2, 1) is None


def test_a_capped_plan_is_one_row_and_teaches_the_controller_nothing(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=CAPACITY, adaptive=True)
    seq = gen.sequence(gen.tokenizer.encode_prompt(PROMPTS[5], raw=True), 16)
    seq.prefill(gen.run_pass)
    p = seq.plan(depth_cap=0)
    assert len(p.window) == 1 and p.capped and len(p.proposal) == 0
    before = (seq.stats.depth_sum, seq.stats.plain_steps)
    seq.commit(p, gen.run_pass(p)["logits"][0], {}, 0.0)
    assert (seq.stats.depth_sum, seq.stats.plain_steps) == before  # a plain step the controller did not choose
    assert seq.plan().capped is False


def _serve(gen: Generator, ids: list[list[int]], n: int) -> tuple[list[list[int]], Scheduler]:
    scheduler = Scheduler(gen).start()
    try:
        results = [h.wait() for h in [scheduler.submit(x, n) for x in ids]]
    finally:
        scheduler.stop()
    return [r.token_ids for r in results], scheduler


def test_served_greedy_on_the_fused_backend_equals_single_request_plain_in_its_mode(fused_bundle):
    """On any CPU: where the served mode batches plain decoding exactly, sequences share single-row
    passes and each equals plain decoding alone in that mode; where it does not, one at a time, said."""
    gen = Generator(fused_bundle, drafter="ngram", max_seq_len=CAPACITY, slots=4, backend="ort-fused")
    ids = [gen.tokenizer.encode_prompt(p, raw=True) for p in PROMPTS]
    got, scheduler = _serve(gen, ids, 12)
    mode = gen.exactness.mode.name
    reference = Generator(fused_bundle, drafter="plain", max_seq_len=CAPACITY, backend="ort-fused", exec_mode=mode)
    assert got == [reference.generate_ids(x, 12).token_ids for x in ids]
    if gen.exactness.plain_batches:
        assert gen.slots == 4 and max(scheduler.batch_sizes) > 1
        assert scheduler.plans["batched"] > 0
    else:
        assert gen.slots == 1 and any("one sequence at a time" in n for n in gen.notes)


def test_drafted_rounds_give_each_slot_its_batch_1_speculative_output(fused_bundle, monkeypatch):
    """The drafted plan runs each slot's own batch-1 verify pass: served output equals single-request
    ngram decoding in the same mode bit for bit, whatever the CPU (the passes are the same passes)."""
    monkeypatch.setattr(pass_policy, "choose", lambda *a: "drafted")
    gen = Generator(fused_bundle, drafter="ngram", max_seq_len=CAPACITY, slots=3, backend="ort-fused",
                    exec_mode="pad2", allow_inexact=True)
    ids = [gen.tokenizer.encode_prompt(p, raw=True) for p in PROMPTS[:4]]
    got, scheduler = _serve(gen, ids, 12)
    alone = Generator(fused_bundle, drafter="ngram", max_seq_len=CAPACITY, backend="ort-fused", exec_mode="pad2",
                      allow_inexact=True)
    assert got == [alone.generate_ids(x, 12).token_ids for x in ids]
    assert scheduler.plans["drafted"] > 0 and scheduler.plans["batched"] == 0
    assert max(scheduler.batch_sizes) == 1  # every drafted pass ran at batch 1


def test_windows_in_one_batched_pass_back_off_when_they_do_not_pay():
    """A backend that batches windows: drafts ride in the one pass while they commit more per second."""
    costs, yields = pass_policy.PassCosts(), pass_policy.Yield(prior=3.0)
    slots, windows = [0, 1, 2, 3], {s: 6 for s in range(4)}
    assert pass_policy.choose(slots, 4, windows, costs, yields, batch_windows=True) == "batched"  # explore c(4, 1)
    costs.observe(4, 1, 0.020)
    assert pass_policy.choose(slots, 4, windows, costs, yields, batch_windows=True) == "windows"  # explore c(4, 6)
    costs.observe(4, 6, 0.060)
    # windows: 12 tokens / 60 ms = 200 tok/s; batched: 4 / 20 ms = 200 tok/s — a tie keeps the single rows
    assert pass_policy.choose(slots, 4, windows, costs, yields, batch_windows=True) == "batched"
    costs.observe(4, 6, 0.030)  # cheaper windows (smoothed: 54 ms → 12 / 54 ms = 222 tok/s)
    assert pass_policy.choose(slots, 4, windows, costs, yields, batch_windows=True) == "windows"


def test_a_ragged_backend_prices_a_pass_by_its_total_rows():
    """native: a pass runs each window's own rows one after the other, so drafts cost the rows they add, not
    the batch padded to the longest; the cost of a pass is keyed by its total rows."""
    assert pass_policy.pass_rows([6, 1, 1, 1], ragged=True) == 9
    assert pass_policy.pass_rows([6, 1, 1, 1], ragged=False) == 6
    costs, yields = pass_policy.PassCosts(), pass_policy.Yield(prior=1.5)
    slots = [0, 1, 2, 3]

    def choose(rows: dict[int, int]) -> str:
        return pass_policy.choose(slots, 4, rows, costs, yields, batch_windows=True, ragged=True)

    assert choose({s: 2 for s in slots}) == "batched"  # explore c(4 slots, 4 rows)
    costs.observe(4, 4, 0.020)
    assert choose({s: 2 for s in slots}) == "windows"  # explore a drafted pass of more rows
    costs.observe(4, 8, 0.024)
    # 4 × 1.5 tokens / 24 ms = 250 tok/s against 4 / 20 ms = 200 tok/s: the drafts' 4 extra rows pay
    assert choose({s: 2 for s in slots}) == "windows"
    # one long draft among short ones: 9 rows (≈ 27 ms) still pay; padded, the pass would be 4 × 6 = 24 rows
    assert choose({0: 6, 1: 1, 2: 1, 3: 1}) == "windows"
    costs.observe(4, 16, 0.060)  # 16 rows: 6 / 60 ms = 100 tok/s, the single rows win
    assert choose({s: 4 for s in slots}) == "batched"
