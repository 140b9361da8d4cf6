"""KV buffers: written in place, rolled back by moving past_len, bounded by the capacity."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.errors import SpecrtError
from specrt.runtime.drafters import Drafter
from specrt.runtime.generate import Generator


def causal(t):
    return np.tril(np.ones((t, t), bool))[None]


def test_kv_is_written_in_place_into_the_preallocated_buffers(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=16)
    dec: OrtDecoder = gen.target
    before = [buf.__array_interface__["data"][0] for buf in dec.kv]
    dec.run(np.array([[5, 6, 7]]), np.arange(3)[None], np.array([0]), causal(3), np.array([[2]]))
    assert [buf.__array_interface__["data"][0] for buf in dec.kv] == before
    assert all(np.abs(buf[0, :, :3]).sum() > 0 for buf in dec.kv), "new rows were not written"
    assert all(np.abs(buf[0, :, 3:]).sum() == 0 for buf in dec.kv), "rows past the window were touched"


def test_rollback_by_moving_past_len_reproduces_a_fresh_pass(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=16)
    dec = gen.target
    dec.run(np.array([[5, 6, 7]]), np.arange(3)[None], np.array([0]), causal(3), np.array([[2]]))
    # a rejected window of 3 tokens at rows 3..5 ...
    dec.run(np.array([[9, 9, 9]]), np.arange(3, 6)[None], np.array([3]), causal(3), np.array([[0]]))
    # ... rolled back: the next pass at past_len 3 must not see the stale rows
    got, _ = dec.run(np.array([[8, 1]]), np.arange(3, 5)[None], np.array([3]), causal(2), np.array([[0, 1]]))
    fresh = Generator(tiny_bundle, max_seq_len=16).target
    want, _ = fresh.run(np.array([[5, 6, 7, 8, 1]]), np.arange(5)[None], np.array([0]), causal(5), np.array([[3, 4]]))
    np.testing.assert_array_equal(got, want)


def test_capacity_ends_generation_with_length(tiny_bundle):
    for drafter in ("plain", "ngram", "draft"):
        gen = Generator(tiny_bundle, drafter=drafter, max_seq_len=12, num_draft_tokens=4)
        res = gen.generate_ids([3, 4, 5, 3, 4], max_new_tokens=100)
        assert res.finish_reason == "length"
        assert len(res.token_ids) == 12 + 1 - 5, drafter  # every KV row used, then one last token
        plain = Generator(tiny_bundle, max_seq_len=12).generate_ids([3, 4, 5, 3, 4], 100)
        assert res.token_ids == plain.token_ids


def test_prompt_beyond_capacity_is_refused(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=8)
    with pytest.raises(SpecrtError, match="prompt has 8 tokens but the KV capacity is 8"):
        gen.generate_ids(list(range(8)), 4)
    with pytest.raises(SpecrtError, match="empty"):
        gen.generate_ids([], 4)


def test_max_new_tokens_is_exact(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64)
    for n in (1, 2, 7):
        res = gen.generate_ids([3, 4, 3, 4, 3], n)
        assert len(res.token_ids) == n and res.finish_reason == "length"


def test_eos_stops_generation(tiny_bundle):
    gen = Generator(tiny_bundle, max_seq_len=64)
    plain = gen.generate_ids([3, 4, 5], 20).token_ids
    gen.model.eos = frozenset({plain[4]})
    res = gen.generate_ids([3, 4, 5], 20)
    cut = plain.index(plain[4]) + 1
    assert res.finish_reason == "stop" and res.token_ids == plain[:cut]


class _Oracle(Drafter):
    """A test drafter that knows the plain greedy continuation and hides it in a tree's 2nd branch:
    node 1 (rank 0) is wrong, node 2 (rank 1) is right, node 3 (child of 2) is right — so the
    accepted path [2, 3] is not contiguous and its KV rows must be moved."""

    name = "oracle"

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.prompt_len = answer, prompt_len

    def propose(self, tokens, max_nodes, max_depth, sampling, rng):
        from specrt.runtime.drafters import Proposal

        done = len(tokens) - self.prompt_len
        nxt = self.answer[done : done + 2]
        if len(nxt) < 2 or max_nodes < 3 or max_depth < 2:
            return Proposal()
        return Proposal([(nxt[0] + 1) % 100, nxt[0], nxt[1]], [0, 0, 2])

    def observe(self, tokens, state=None):
        pass


def test_tree_acceptance_compacts_kv_rows_exactly(tiny_bundle):
    prompt = [3, 4, 5, 6]
    plain = Generator(tiny_bundle, max_seq_len=64).generate_ids(prompt, 12).token_ids
    gen = Generator(tiny_bundle, max_seq_len=64)
    gen.drafter = _Oracle(plain, len(prompt))
    res = gen.generate_ids(prompt, 12)
    assert res.token_ids == plain
    assert res.stats.accepted >= 6 and res.stats.mean_accepted_len > 2  # the hidden branch was taken
    # the compacted cache equals a fresh prefill of the committed tokens, bitwise
    committed = prompt + res.token_ids[:-1]
    fresh = Generator(tiny_bundle, max_seq_len=64).target
    n = len(committed)
    fresh.run(np.array([committed]), np.arange(n)[None], np.array([0]), causal(n), np.array([[n - 1]]))
    for got, want in zip(gen.target.kv, fresh.kv, strict=True):
        np.testing.assert_array_equal(got[:, :, :n], want[:, :, :n])
