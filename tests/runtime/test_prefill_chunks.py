"""Prefill chunk sizes (runtime/sequence.py): batch-1 generation prefills in GENERATE_PREFILL_CHUNK rows, the
serving scheduler's passes (`prefill_passes()`) in PREFILL_CHUNK, and both give the same first token and KV
rows, on the fake target here and bitwise on the real model (tests/runtime/test_lossless_real.py)."""

from __future__ import annotations

import numpy as np

from specrt.runtime import sequence
from specrt.runtime.drafters import Drafter, Proposal
from specrt.runtime.drafters.features import TargetState
from specrt.runtime.sequence import Sequence
from specrt.runtime.settings import Request, SequenceTerms
from tests.runtime.test_sequence import FakeTarget, H, plain_greedy

CAPACITY = 400


class _Plain(Drafter):
    name = "plain"

    def propose(self, tokens, max_nodes, max_depth, sampling, rng) -> Proposal:
        return Proposal()

    def observe(self, tokens, state=None) -> None:
        pass


def _sequence(prompt: list[int]) -> tuple[Sequence, FakeTarget]:
    target = FakeTarget(CAPACITY)
    state = TargetState.allocate(CAPACITY + 1, H, None)
    return Sequence(Request(prompt, 4), SequenceTerms(CAPACITY), _Plain(), state, target.compact), target


def test_generation_prefills_in_larger_chunks_than_the_scheduler():
    assert sequence.GENERATE_PREFILL_CHUNK > sequence.PREFILL_CHUNK
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 32, 300)]
    served, _ = _sequence(prompt)
    assert [len(p.window) for p in served.prefill_passes()] == [64, 64, 64, 64, 44]
    seq, target = _sequence(prompt)
    first = seq.prefill(target.run)
    big = sequence.GENERATE_PREFILL_CHUNK
    assert [len(p.window) for p in target.passes] == [big] * (300 // big) + [300 % big]
    assert [p.past for p in target.passes] == list(range(0, 300, big))
    assert first == plain_greedy(prompt, 1) and target.kv[:300].tolist() == prompt
    other, again = _sequence(prompt)
    assert other.prefill(again.run, chunk=7) == first and len(again.passes) == -(-300 // 7)
