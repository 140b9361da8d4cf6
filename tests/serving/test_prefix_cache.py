"""The serving prefix cache: a request that starts like an earlier prompt (or an earlier prompt and its answer)
copies their KV rows instead of prefilling them, the rows are bitwise those a prefill writes, every served
answer stays the plain single-request answer, and the cache holds its memory bound."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.generate import Generator
from specrt.runtime.sequence import Pass
from specrt.runtime.tree import Tree
from specrt.serving.prefix_cache import PrefixCache, cache_mb
from specrt.serving.scheduler import Scheduler
from tests.helpers import export_tiny

HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="module", params=["native", "ort"])
def bundle(request, tmp_path_factory, tiny_bundle):
    """An int4 tiny Llama (the native backend's) and the fp32 tiny bundle (ONNX Runtime's)."""
    if request.param == "ort":
        return tiny_bundle, "ort"
    return export_tiny(tmp_path_factory.mktemp("prefix"), "llama", **HEAD_DIM_64), "native"


def _prompts(vocab: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(5, vocab, 27)]
    second = first[:21] + [int(t) for t in rng.integers(5, vocab, 9)]  # 21 shared: two blocks of 8
    return first, second


def _vocab(gen: Generator) -> int:
    return min(gen.model.manifest.target.config.vocab_size, 1000)


def test_cached_rows_are_the_rows_a_prefill_writes(bundle):
    path, backend = bundle
    gen = Generator(path, drafter="plain", max_seq_len=64, slots=1, backend=backend)
    first, second = _prompts(_vocab(gen))
    scheduler = Scheduler(gen, prefix_cache_mb=8).start()
    try:
        handles = [scheduler.submit(first, 6)]
        handles[0].wait()
        for buf in gen.model.decoder.kv:  # rows of another request: what the second must not read
            buf[:] = 7
        handles.append(scheduler.submit(second, 1))  # its first token ends it: no pass writes after its prefill
        handles[1].wait()
    finally:
        scheduler.stop()
    assert [h.cached_tokens for h in handles] == [0, 16]
    served = gen.model.kv_rows(0, 0, len(second))
    fresh = Generator(path, drafter="plain", max_seq_len=64, slots=1, backend=backend)
    n = len(second)
    fresh.model.run_batch([Pass(np.asarray(second, np.int64), 0, Tree.chain(n - 1), np.array([n - 1]))], 0)
    assert np.array_equal(served, fresh.model.kv_rows(0, 0, n))
    for ids, h, k in zip((first, second), handles, (6, 1), strict=True):
        assert h.result.token_ids == fresh.generate_ids(ids, k).token_ids


def test_the_next_turn_reuses_the_answer_and_output_is_unchanged(bundle):
    """Several slots and a drafter: the second turn (first prompt + its answer + more) finds the answer's
    rows too, and every answer equals plain single-request decoding."""
    path, backend = bundle
    gen = Generator(path, drafter="ngram", max_seq_len=64, slots=3, backend=backend)
    first, _ = _prompts(_vocab(gen))
    scheduler = Scheduler(gen, prefix_cache_mb=8).start()
    try:
        answer = scheduler.submit(first, 13).wait().token_ids
        turn = first + answer + [7, 8, 9]
        handles = [scheduler.submit(first, 13), scheduler.submit(turn, 8)]  # one admission: they share passes
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    assert len(answer) == 13
    assert [h.cached_tokens for h in handles] == [24, 32]  # the turn's: 27 + 13 - 1 rows written, 4 blocks
    plain = Generator(path, drafter="plain", max_seq_len=64, backend=backend)
    assert results[0].token_ids == answer == plain.generate_ids(first, 13).token_ids
    assert results[1].token_ids == plain.generate_ids(turn, 8).token_ids
    assert "specrt_prefix_cache_hits_total 56.0" in scheduler.metrics.render().decode()


def test_a_whole_prompt_is_never_matched_and_tokens_are_compared_exactly():
    cache = PrefixCache(1 << 20, block=4)
    rows = np.arange(2 * 3 * 16 * 2, dtype=np.float32).reshape(2, 3, 16, 2)
    read = lambda a, b: rows[:, :, a:b]  # noqa: E731
    assert cache.insert(list(range(16)), read) == 4
    assert len(cache.match(list(range(16)))) == 3  # the last block holds the last token: it must be prefilled
    assert len(cache.match(list(range(17)))) == 4
    got = np.concatenate([b.rows for b in cache.match(list(range(17)))], axis=2)
    assert np.array_equal(got, rows)
    assert len(cache.match([0, 1, 2, 3, 4, 5, 6, 99, 8, 9])) == 1  # one token off: the block differs
    assert cache.match([9] + list(range(1, 16))) == []
    assert cache.insert(list(range(12)), read) == 0  # cached already


def test_the_least_recently_used_leaves_go_first_and_the_bound_holds():
    block = np.zeros((2, 1, 4, 2), np.float32)  # 64 bytes a block
    cache = PrefixCache(5 * block.nbytes, block=4)
    read = lambda a, b: np.zeros((2, 1, b - a, 2), np.float32)  # noqa: E731
    a, b = [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 5, 5, 5, 5]
    assert cache.insert(a, read) == 3 and cache.insert(b, read) == 1  # b shares a's first block
    cache.match(a + [0])  # a is now the more recent
    assert cache.insert([7] * 8, read) == 2  # two more blocks: only b's leaf may go (a's first block has a child)
    assert len(cache) == 5 and cache.nbytes <= cache.capacity
    assert len(cache.match(b + [0])) == 1 and len(cache.match(a + [0])) == 3
    big = PrefixCache(block.nbytes - 1, block=4)
    assert big.insert([1] * 8, read) == 0 and big.nbytes == 0  # a block larger than the cache is not kept


def test_a_backend_whose_kv_is_not_in_host_memory_refuses_a_cache(tiny_bundle):
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, backend="ort-device")
    assert not gen.model.host_kv and cache_mb(None, False) == 0 and cache_mb(None, True) > 0
    with pytest.raises(SpecrtError, match="--prefix-cache-mb 8: the ort-device backend's KV cache is not in host"):
        Scheduler(gen, prefix_cache_mb=8)


def test_usage_reports_cached_prompt_tokens_only_where_a_cache_runs():
    from specrt.serving.responses import usage

    assert usage(30, 4) == {"prompt_tokens": 30, "completion_tokens": 4, "total_tokens": 34}
    assert usage(30, 4, 24)["prompt_tokens_details"] == {"cached_tokens": 24}


def test_requests_admitted_together_find_what_the_first_of_them_cached(bundle):
    """The cache is read at a prompt's first chunk, not at admission: three requests queued at once, one
    chunk a step, the second and third find the first's shared prefix."""
    path, backend = bundle
    gen = Generator(path, drafter="plain", max_seq_len=64, slots=3, backend=backend)
    first, second = _prompts(_vocab(gen))
    third = second[:17] + [5, 6, 7, 8]
    scheduler = Scheduler(gen, prefix_cache_mb=8)
    handles = [scheduler.submit(ids, 5) for ids in (first, second, third)]
    scheduler.start()
    try:
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    assert [h.cached_tokens for h in handles] == [0, 16, 16]
    plain = Generator(path, drafter="plain", max_seq_len=64, backend=backend)
    for ids, r in zip((first, second, third), results, strict=True):
        assert r.token_ids == plain.generate_ids(ids, 5).token_ids
