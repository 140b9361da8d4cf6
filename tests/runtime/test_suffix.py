"""Suffix decoding: the longest match's most frequent continuations, as a tree within the generator's
limits, over the sequence itself and a bounded store of earlier sequences (shared by a server's slots)."""

from __future__ import annotations

import heapq
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from specrt.errors import SpecrtError
from specrt.runtime.drafters import DrafterContext, suffix
from specrt.runtime.drafters.ngram import lookup
from specrt.runtime.drafters.suffix import (
    MAX_MATCH,
    STORE_WEIGHT,
    TOKENS_PER_MATCHED,
    Store,
    Suffix,
    match_lengths,
)
from specrt.runtime.tree import Tree, resolve_tree

pytestmark = pytest.mark.covers("proposal", kinds=("suffix",))

SHAPES = [(None, 5), (None, 3), ("binary", 5), ("default", 5), ("wide", 5)]


def drafter(tree: str | None = None, k: int = 5, **options) -> Suffix:
    return Suffix(DrafterContext(Path("."), None, 4096, 1, resolve_tree(tree, k), options))


def propose(d: Suffix, tokens: list[int], max_nodes: int = 64, max_depth: int = 64):
    return d.propose(tokens, max_nodes, max_depth, None, None)


# ── an independent recomputation ────────────────────────────────────────────────────────────
def grow(conts: list[tuple[list[int], int]], nodes: int, depth: int, width: int, min_prob: float):
    """Best-first tree over continuations (tokens, position of the match's last token), counted as
    prefix tuples; (tokens, parents, score)."""
    counts, has_next, latest = Counter(), Counter(), {}
    for cont, pos in conts:
        for d in range(len(cont)):
            pre = tuple(cont[: d + 1])
            counts[pre] += 1
            has_next[pre[:-1]] += 1
            latest[pre] = max(latest.get(pre, -1), pos + d + 1)

    def kids(u):
        cs = [c for c in counts if len(c) == len(u) + 1 and c[:-1] == u]
        return sorted(cs, key=lambda c: (-counts[c], -latest[c]))[:width]

    tokens, parents, score, heap, tick = [], [], 0.0, [], 0

    def push(parent, u, prob):
        nonlocal tick
        for c in kids(u):
            if (p := prob * counts[c] / has_next[u]) >= min_prob:
                heapq.heappush(heap, (-p, tick, parent, c))
                tick += 1

    push(0, (), 1.0)
    while heap and len(tokens) < nodes:
        neg, _, parent, c = heapq.heappop(heap)
        tokens.append(c[-1])
        parents.append(parent)
        score -= neg
        if len(c) < depth and len(tokens) < nodes:
            push(len(tokens), c, -neg)
    return tokens, parents, score


def reference(context: list[int], stored: list[list[int]], nodes: int, depth: int, width: int, min_prob: float):
    """Every match length of every corpus (the sequence, then the store), found by comparing slices."""
    best, best_score = ([], []), 0.0
    for docs, own, weight in (([context], True, 1.0), (stored, False, STORE_WEIGHT)):
        for m in range(min(MAX_MATCH, len(context)), 0, -1):
            cap, conts, base = min(depth, TOKENS_PER_MATCHED * m), [], 0
            for doc in docs:
                for p in range(m - 1, len(doc) - 1 if own else len(doc)):  # never the context's own end
                    if doc[p - m + 1 : p + 1] == context[-m:]:
                        conts.append((doc[p + 1 : p + 1 + cap], base + p))
                base += len(doc) + 1
            tokens, parents, score = grow(conts, nodes, cap, width, min_prob)
            if score * weight > best_score + 1e-9:  # a tie within rounding keeps the earlier one
                best, best_score = (tokens, parents), score * weight
    return best


# match_lengths and children take arrays for many positions and Python loops for few: each way alone, and the mix
WAYS = {"arrays": (0, 0), "python": (10**9, 10**9), "mixed": (suffix.FEW_MATCHES, suffix.FEW_NEXT)}


@pytest.fixture(params=list(WAYS))
def way(request, monkeypatch):
    few_matches, few_next = WAYS[request.param]
    monkeypatch.setattr(suffix, "FEW_MATCHES", few_matches)
    monkeypatch.setattr(suffix, "FEW_NEXT", few_next)
    return request.param


def test_match_lengths_equal_a_slice_comparison(way):
    rng = np.random.default_rng(1)
    for _ in range(40):
        arr = rng.integers(0, 3, int(rng.integers(2, 80))).tolist()
        context = rng.integers(0, 3, int(rng.integers(1, 40))).tolist()
        pos = np.array([p for p, t in enumerate(arr) if t == context[-1]], np.int64)
        want = [max(m for m in range(1, min(MAX_MATCH, len(context), p + 1) + 1)
                    if arr[p - m + 1 : p + 1] == context[-m:]) for p in pos]
        assert match_lengths(np.asarray(arr, np.int32), pos, context).tolist() == want


@pytest.mark.parametrize("tree,k", SHAPES)
def test_proposal_equals_the_reference_on_random_sequences(tree, k, way):
    """Small vocabularies: many matches, many ties (broken towards the latest occurrence)."""
    rng = np.random.default_rng(k + len(tree or ""))
    shape = resolve_tree(tree, k)
    width = max(len(shape.children(i)) for i in range(shape.size))
    for case in range(30):
        min_prob = [0.1, 0.0, 0.3][case % 3]
        vocab = int(rng.integers(2, 7))
        stored = [rng.integers(0, vocab, int(rng.integers(1, 60))).tolist() for _ in range(case % 4)]
        d = drafter(tree, k, suffix_min_prob=min_prob)
        for s in stored:
            d.finish(s)
        tokens = rng.integers(0, vocab, int(rng.integers(1, 120))).tolist()
        max_depth = int(rng.integers(1, 9))
        prop = propose(d, tokens, 64, max_depth)
        want = reference(tokens, stored, shape.size - 1, min(shape.depth.max(), max_depth), width, min_prob)
        assert (prop.tokens, prop.parents) == want, (case, tokens, stored)
        assert prop.q is None  # deterministic: one-hot q for rejection sampling


def test_most_frequent_continuation_wins_where_prompt_lookup_takes_the_latest():
    tokens = [5, 7, 1, 5, 7, 2, 5, 8, 3, 5]  # 5 → 7 twice, → 8 once (latest); a 1-token match drafts ≤ 2
    assert lookup(tokens, k=5, max_n=3) == [8, 3]
    assert propose(drafter(), tokens).tokens == [7, 2]  # then 1 or 2 (once each): the latest, 2


def test_longer_match_is_preferred_and_short_match_drafts_short():
    tokens = [1, 2, 3, 9, 9, 5, 3, 7, 4, 2, 3]  # [2, 3] once → 9 9 5 3 (≤ 4); [3] alone: 9 or 7
    assert propose(drafter(), tokens).tokens == [9, 9, 5, 3]
    assert propose(drafter(), [4, 6, 8, 4]).tokens == [6, 8]  # a 1-token match: 2 tokens at most


@pytest.mark.parametrize("tree,k", SHAPES)
def test_tree_respects_every_limit(tree, k):
    rng = np.random.default_rng(7)
    shape = resolve_tree(tree, k)
    width = max(len(shape.children(i)) for i in range(shape.size))
    for case in range(40):
        d = drafter(tree, k)
        stored = rng.integers(0, 6, 200).tolist()
        d.finish(stored)
        tokens = rng.integers(0, 6, int(rng.integers(2, 200))).tolist()
        max_nodes, max_depth = [(1, 9), (3, 2), (64, 64), (2, 1)][case % 4]
        prop = propose(d, tokens, max_nodes, max_depth)
        t = Tree.from_parents([-1, *prop.parents])  # parents before children
        longest = 0  # the longest suffix of the context found earlier (if m tokens are not, m + 1 are not)
        while any(doc[p - longest - 1 : p] == tokens[-longest - 1 :] for doc in (tokens[:-1], stored)
                  for p in range(longest + 1, len(doc) + 1)):
            longest += 1
        assert len(prop) <= min(max_nodes, shape.size - 1)
        assert t.depth.max() <= min(max_depth, shape.depth.max(), TOKENS_PER_MATCHED * longest)
        assert all(len(t.children(i)) <= width for i in range(t.size))
        assert all(len({prop.tokens[c - 1] for c in t.children(i)}) == len(t.children(i)) for i in range(t.size))
        assert not shape.is_chain or t.is_chain
        assert prop.limited(max_nodes, max_depth).tokens == prop.tokens  # nothing left for the runtime to cut


def test_tree_nodes_option_sets_the_node_budget():
    tokens = [0, 1, 2, 3, 0, 1, 4, 5, 0, 1, 2, 6, 0, 1]
    assert len(propose(drafter("default"), tokens)) > 4
    assert len(propose(drafter("default", tree_nodes=4), tokens)) == 4


def test_store_holds_at_most_its_bound_and_evicts_the_oldest():
    store = Store(max_tokens=10)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7])
    assert store.tokens == 7 and len(store) == 2
    store.add([8, 9, 10, 11])  # 11 > 10: the oldest goes
    assert [s.tolist() for s in store.seqs] == [[5, 6, 7], [8, 9, 10, 11]] and store.tokens == 7
    store.add(list(range(100, 125)))  # longer than the bound: its last 10 tokens, alone
    assert [s.tolist() for s in store.seqs] == [list(range(115, 125))] and store.tokens == 10
    assert store.index().n == 11  # the tokens and one separator
    rng = np.random.default_rng(3)
    added = []
    for _ in range(50):
        added.append(rng.integers(0, 9, int(rng.integers(1, 8))).tolist())
        store.add(added[-1])
        assert store.tokens == sum(map(len, store.seqs)) <= 10
        assert store.index().n == store.tokens + len(store)  # what the index holds: tokens and separators
        assert [s.tolist() for s in store.seqs] == added[len(added) - len(store):]  # the newest, in order


def test_drafts_from_the_store_until_the_sequence_is_evicted():
    d = drafter(suffix_store=20)
    d.finish([40, 41, 42, 43, 44, 45])
    context = [7, 40, 41]
    assert propose(d, context).tokens == [42, 43, 44, 45]
    d.finish(list(range(60, 70)))
    assert propose(d, context).tokens == [42, 43, 44, 45]  # 16 tokens stored: still there
    d.finish(list(range(70, 80)))  # 26 > 20: the oldest is evicted
    assert propose(d, context).tokens == []
    assert propose(drafter(suffix_store=0), context).tokens == []  # no store


def test_a_reused_drafter_files_the_previous_sequence_and_shares_its_store():
    d = drafter()
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    for n in range(3, len(first) + 1):
        d.observe(first[:n])
    assert len(d.store) == 0  # one sequence growing
    d.observe([9, 3, 4])  # does not extend it: a new sequence; the finished one is stored
    assert len(d.store) == 1 and propose(d, [9, 3, 4]).tokens == [5, 6, 7, 8]
    other = drafter()
    other.share(d)
    d.finish([9, 3, 4, 20, 21, 22, 23])
    assert len(other.store) == 2 and propose(other, [0, 21]).tokens == [22, 23]


@pytest.mark.parametrize("options", [{"suffix_min_prob": 1.5}, {"suffix_store": -1}])
def test_bad_options_are_refused(options):
    with pytest.raises(SpecrtError, match="suffix_"):
        drafter(**options)


# ── on the real model ───────────────────────────────────────────────────────────────────────
REWRITE = "Repeat this sentence exactly, twice: the quick brown fox jumps over the lazy dog."
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def plain_runs(real_generator):
    """A chat prompt (a 40-token answer that seldom repeats itself) and a rewrite prompt (copies from
    itself): their ids and plain greedy output."""
    gen = real_generator.use("plain")
    ids = [gen.tokenizer.encode_prompt(p) for p in ("Name three colours.", REWRITE)]
    return ids, [gen.generate_ids(x, NEW_TOKENS).token_ids for x in ids]


@pytest.fixture(scope="module")
def suffix_generator(real_generator):
    from specrt.runtime.generate import Generator

    return Generator(real_generator.bundle, "suffix", max_seq_len=1024, threads=real_generator.threads)


@pytest.mark.slow
@pytest.mark.covers("lossless", kinds=("suffix",))
@pytest.mark.parametrize("tree", [None, "default"])
def test_greedy_output_equals_plain_and_repeats_are_drafted_from_the_store(suffix_generator, plain_runs, tree):
    gen = suffix_generator.use("suffix", tree)  # a fresh drafter (and store) per tree shape
    ids, plain = plain_runs
    runs = [gen.generate_ids(x, NEW_TOKENS) for x in [*ids, ids[0]]]  # the last one repeats the first
    for res, want in zip(runs, [*plain, plain[0]], strict=True):
        assert res.token_ids == want and res.lossless
    first, repeat = runs[0].stats, runs[2].stats
    assert repeat.mean_accepted_len > first.mean_accepted_len + 1  # drafted from the stored answer


@pytest.mark.slow
def test_each_scope_remembers_only_its_own_sequences_until_it_forgets(suffix_generator, plain_runs):
    """What a benchmark relies on: one engine's stored answer never drafts for another engine."""
    prompt = plain_runs[0][0]

    def run(scope):
        st = suffix_generator.use("suffix", scope=scope).generate_ids(prompt, NEW_TOKENS).stats
        return st.steps, st.accepted

    first = run("a")
    assert run("b") == first  # b has not seen a's answer
    steps, accepted = run("a")  # a has: its own answer to the same prompt drafts the repeat
    assert accepted > first[1] + NEW_TOKENS // 2 and steps < first[0]
    suffix_generator.forget()
    assert run("a") == first


@pytest.mark.slow
@pytest.mark.covers("serving", kinds=("suffix",))
def test_served_repeat_of_an_earlier_output_is_drafted_from_the_servers_store(real_generator, plain_runs):
    """Request B finishes in slot 1; its repeat lands in slot 0, whose drafter never saw it: only the
    store every slot shares, which the scheduler gives each finished sequence, can draft it."""
    from specrt.runtime.generate import Generator
    from specrt.serving.scheduler import Scheduler

    (ids, _), (want, _) = plain_runs
    gen = Generator(real_generator.bundle, "suffix", max_seq_len=512, slots=2, threads=real_generator.threads)
    scheduler = Scheduler(gen)
    a = scheduler.submit(gen.tokenizer.encode_prompt("Hi."), 2)
    b = scheduler.submit(ids, NEW_TOKENS)  # both waiting when the loop starts: slot 0, slot 1
    scheduler.start()
    try:
        a.wait()
        first = b.wait()
        assert all(s.handle is None for s in scheduler.slots)
        repeat = scheduler.submit(ids, NEW_TOKENS).wait()  # slot 0: the first free one
    finally:
        scheduler.stop()
    assert first.token_ids == repeat.token_ids == want
    assert repeat.stats.mean_accepted_len > first.stats.mean_accepted_len + 1, (first.stats, repeat.stats)
