"""The continuous-batching scheduler: batched verify passes give each sequence what it gets alone."""

from __future__ import annotations

import numpy as np
import pytest

from specrt.runtime.clock import FakeClock
from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tree import Tree
from specrt.serving.scheduler import Scheduler, SchedulerFull
from tests.scripted import Script, ScriptedDrafter, paced

PROMPTS = ["Say hi.", "List three colors, then list them again.", "What is 2+2?", "Write a haiku about rain.",
           "Explain what a cat is.", "Count from 1 to 10."]
PASS_S = 0.01  # what a target pass costs on a test's fake clock, whatever its shape


def _pass_logits(gen: Generator, prompts: list[list[int]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefill each prompt alone in its slot, then one batched 3-token chain pass over all slots vs the
    same pass per slot alone; returns (batched logits, single logits)."""
    from specrt.runtime.sequence import Pass

    plans = []
    run = gen.model.run_batch
    for b, ids in enumerate(prompts):
        n = len(ids)
        run([Pass(np.asarray(ids, np.int64), 0, Tree.chain(n - 1), np.array([n - 1]))], b)
        plans.append(Pass(np.asarray([ids[-1], 11, 12][: 1 + b % 3], np.int64), n - 1, Tree.chain(b % 3),
                          np.arange(1 + b % 3)))
    batched = run(plans, 0)
    batched = [batched.of(b)["logits"][0].copy() for b in range(len(plans))]
    single = [run([p], b).of(0)["logits"][0].copy() for b, p in enumerate(plans)]
    return batched, single


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_batched_pass_equals_single_passes(which, tiny_bundle, real_bundle):
    """Batch invariance: rows of a ragged batched pass (different past_len, window lengths, padding)
    equal the same rows computed one sequence at a time, bit for bit."""
    bundle = tiny_bundle if which == "tiny" else real_bundle
    gen = Generator(bundle, drafter="plain", max_seq_len=64 if which == "tiny" else 256, slots=3)
    prompts = [gen.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    batched, single = _pass_logits(gen, prompts)
    for b, s in enumerate(single):
        m = s.shape[0]
        assert np.array_equal(batched[b][:m], s), (b, float(np.abs(batched[b][:m] - s).max()))


@pytest.mark.parametrize("drafter", ["plain", "ngram", "draft"])
def test_served_greedy_equals_single_request_plain(drafter, tiny_bundle, tiny_reference):
    gen = Generator(tiny_bundle, drafter=drafter, max_seq_len=64, slots=4)
    scheduler = Scheduler(gen)
    ids = [gen.tokenizer.encode_prompt(p, raw=True) for p in PROMPTS]
    handles = [scheduler.submit(x, 8 + 3 * i) for i, x in enumerate(ids)]  # 6 requests, 4 slots: admission
    scheduler.start()  # all queued first: four start together, so passes are shared on any machine
    try:
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    for i, (x, r) in enumerate(zip(ids, results, strict=True)):
        assert r.token_ids == tiny_reference.generate_ids(x, 8 + 3 * i).token_ids, i
    assert max(scheduler.batch_sizes) > 1  # verify passes really were shared
    assert min(scheduler.batch_sizes) >= 1


@pytest.mark.slow
def test_served_greedy_equals_single_request_on_real_model(real_bundle, real_generator):
    clock = FakeClock()  # every pass costs the same: the pass plan (hence whether drafts run) is the script's
    gen = Generator(real_bundle, drafter="ngram", max_seq_len=256, slots=4, clock=clock)
    scheduler = Scheduler(gen, runner=paced(gen, clock, PASS_S))
    ids = [gen.tokenizer.encode_prompt(p) for p in PROMPTS[:4]]
    handles = [scheduler.submit(x, 24) for x in ids]
    scheduler.start()
    try:
        results = [h.wait() for h in handles]
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
    """Stepped by the test (no thread): each fact holds when the test acts."""
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1)
    scheduler = Scheduler(gen, max_waiting=1)
    ids = gen.tokenizer.encode_prompt(PROMPTS[0], raw=True)
    long = scheduler.submit(ids, 60 - len(ids))
    scheduler.step()  # admitted, its prompt's pass: the first token
    scheduler.step()
    assert long.result is None and scheduler.running == 1 and len(next(iter(long))) == 1
    waiting = scheduler.submit(ids, 5)  # queued
    with pytest.raises(SchedulerFull, match="retry later"):
        scheduler.submit(ids, 5)
    long.cancel()
    events = scheduler.step()  # the cancellation frees the slot; the waiting request takes it
    assert [type(e).__name__ for e in events][:1] == ["Ended"] and events[0].handle is long
    r = long.wait()
    assert r.finish_reason == "cancelled" and len(r.token_ids) == 2
    assert scheduler.running == 1 and not scheduler.waiting
    while scheduler.running:
        scheduler.step()
    assert waiting.wait().token_ids == tiny_reference.generate_ids(ids, 5).token_ids


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


def _spy_on_proposals(drafter) -> list[Tree]:
    """Record the tree of every proposal `drafter` makes from now on."""
    trees, propose = [], drafter.propose

    def spy(*args, **kwargs):
        prop = propose(*args, **kwargs)
        trees.append(prop.tree())
        return prop

    drafter.propose = spy
    return trees


def test_every_slot_drafts_like_the_generators_current_drafter(tiny_bundle, tiny_reference):
    """`use(tree=…, adaptive=…)` after construction: every slot (not only slot 0) drafts that tree with its
    own drafter and controller, and served output still equals single-request plain output."""
    from specrt.runtime.tree import resolve_tree

    gen = Generator(tiny_bundle, drafter="draft", max_seq_len=64, slots=3, num_draft_tokens=3)
    gen.use("draft", tree="binary", adaptive=True)
    binary = resolve_tree("binary", gen.k)
    assert gen.drafter_tree == binary != gen.tree  # not the generator's default shape (a chain of 3)
    scheduler = Scheduler(gen)
    drafters = [s.drafter for s in scheduler.slots]
    assert len({id(d) for d in drafters}) == 3  # each slot has its own caches
    assert [d.shape for d in drafters] == [binary] * 3
    assert all(s.control is not None and s.control.k == gen.max_depth for s in scheduler.slots)
    assert len({id(s.control) for s in scheduler.slots}) == 3
    spied = [_spy_on_proposals(d) for d in drafters]
    ids = [gen.tokenizer.encode_prompt(p, raw=True) for p in PROMPTS]
    handles = [scheduler.submit(x, 8 + 3 * i) for i, x in enumerate(ids)]  # queued first: slots 0, 1, 2 all serve
    scheduler.start()
    try:
        results = [h.wait() for h in handles]
    finally:
        scheduler.stop()
    for i, (x, r) in enumerate(zip(ids, results, strict=True)):
        assert r.token_ids == tiny_reference.generate_ids(x, 8 + 3 * i).token_ids, i
    for b, trees in enumerate(spied):  # the first steps draft at full depth: the whole binary tree
        assert trees and trees[0] == binary, (b, trees[:1])


SLOW_DRAFT_S = 0.02  # a wrong draft also costs this much on the fake clock: speculating can only lose


def test_each_slot_adapts_its_own_draft_depth(tiny_bundle, tiny_reference):
    """Two requests share every verify pass: one whose drafts are always accepted, one whose drafts are
    always rejected (and slow). Each slot's controller sees only its own sequence: acceptance near 1 vs
    near 0, deep drafts vs mostly plain steps. A controller shared between slots would mix the two. The
    seconds every choice is made from are the fake clock's: a function of this script alone."""
    right, wrong = (tuple(tiny_reference.tokenizer.encode_prompt(p, raw=True)) for p in PROMPTS[1:3])
    lengths = {right: 40, wrong: 24}
    want = {p: tiny_reference.generate_ids(list(p), n).token_ids for p, n in lengths.items()}
    scripts = {right: Script(want[right]), wrong: Script(want[wrong], right=False, seconds=SLOW_DRAFT_S)}
    clock = FakeClock()
    gen = Generator(tiny_bundle, drafter="ngram", max_seq_len=64, slots=2, adaptive=True, num_draft_tokens=4,
                    clock=clock)
    assert gen.slots == 2 and gen.drafter_name == "ngram", gen.notes
    scheduler = Scheduler(gen, runner=paced(gen, clock, PASS_S))
    for slot in scheduler.slots:  # each slot drafts from the script
        slot.drafter = ScriptedDrafter(scripts, clock)
    handles = {p: scheduler.submit(list(p), n) for p, n in lengths.items()}  # slot 0: right, slot 1: wrong
    scheduler.start()
    try:
        results = {p: h.wait() for p, h in handles.items()}
    finally:
        scheduler.stop()
    assert max(scheduler.batch_sizes) == 2  # the two really shared passes
    for p in lengths:
        assert results[p].token_ids == want[p]
    good, bad = scheduler.slots[0].control, scheduler.slots[1].control
    # below the prior (1/2) only by rejections, above 0.8 only by acceptances: one controller shared by both
    # could not be both
    assert bad.acceptance()[0] < 0.5 and good.acceptance()[0] > 0.8, (good.summary(), bad.summary())
    assert results[right].stats.accepted > 0 and results[wrong].stats.accepted == 0
    deep, shallow = results[right].stats, results[wrong].stats
    assert shallow.plain_steps > 0 and deep.mean_draft_depth > shallow.mean_draft_depth + 1, (
        deep.to_dict(), shallow.to_dict())


def test_alive_follows_the_scheduler_thread(tiny_bundle):
    scheduler = Scheduler(Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=1))
    assert not scheduler.alive
    scheduler.start()
    try:
        assert scheduler.alive
    finally:
        scheduler.stop()
    assert not scheduler.alive


def test_a_scheduler_writes_every_kv_page_before_any_request(tiny_bundle):
    """KV buffers are allocated lazily: the server writes all of them at start (every element: the marks
    below are gone), so no request's pass pays for the first touch of a page."""
    gen = Generator(tiny_bundle, drafter="plain", max_seq_len=64, slots=4)
    for buf in gen.target.kv:
        buf[...] = 1.0
    scheduler = Scheduler(gen)
    assert scheduler.prefaulted == sum(buf.nbytes for buf in gen.target.kv) > 0
    assert all(not buf.any() for buf in gen.target.kv)
