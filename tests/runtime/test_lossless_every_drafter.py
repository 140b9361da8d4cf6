"""The product's promise on the real model, on whatever CPU runs this: greedy speculative output
equals the target's own plain greedy output, token for token, for every drafter (chains and the
default tree) and for batched serving, on the int4 default configuration — and on fp32 for prompt
lookup and EAGLE-3 (every learned drafter is also held to plain output on the prompts it was trained
on, on the int4 bundle: tests/runtime/test_trained_real.py).

The execution mode that makes this hold is measured on this machine (runtime/exactness.py); which
mode it is differs between CPU kinds, and no test here asserts which. A divergence fails outright:
no tie-breaking excuse, since the passes are meant to be bit-identical to plain decoding's.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest

from specrt.kinds import kinds, runtime_drafters
from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler

pytestmark = pytest.mark.slow

PROMPTS = [json.loads(line)["prompt"] for line in
           (resources.files("specrt") / "data" / "bench_prompts.jsonl").read_text().splitlines()]
NEW_TOKENS = 64
# each drafter alone: the first 48 of those (greedy's first 48 tokens are its 64's first 48); CI's time goes to
# covering every drafter and shape rather than the last 16 tokens of each
SPECULATED = 48
# (drafter, tree): None is the drafter's default shape (chain; Medusa: its stored tree; EAGLE-2/3: dynamic)
# every runtime drafter of the registry in its default shape on every prompt, plus the other shapes users
# pick on every other prompt (each category still: CI's time goes to the shapes users get by default)
OTHER_SHAPES = [("ngram", "default"), ("draft", "default"), ("medusa", "chain"), ("eagle", "default")]
INT4 = [(d, None) for d in runtime_drafters() if d != "plain"] + OTHER_SHAPES
FP32 = [("ngram", None), ("ngram", "default"), ("eagle3", None)]
CASES = [("int4", d, t) for d, t in INT4] + [("fp32", d, t) for d, t in FP32]
# every kind served (its first runtime drafter), on the default int4 bundle; ngram on fp32 too; eagle3-suffix
# (its slots share one suffix store)
SERVED = [("int4", next(iter(spec.runtime))) for spec in kinds().values()] + [("fp32", "ngram"), ("int4", "eagle3-suffix")]
BUNDLES = ["int4", "fp32"]
# the prompts each bundle runs: every one on the default int4 bundle, every other one (each category still) on fp32
STRIDE = {"int4": 1, "fp32": 2}


@pytest.fixture(scope="module")
def bundles(trained_int4_bundle, trained_bundle):
    return {"int4": trained_int4_bundle, "fp32": trained_bundle}


@pytest.fixture(scope="module")
def reference(bundles):
    """Per bundle: a generator and plain greedy output for every prompt (computed once)."""
    out = {}
    for name, bundle in bundles.items():
        gen = Generator(bundle, "plain", max_seq_len=512, num_draft_tokens=4)
        assert gen.exactness.lossless, gen.exactness.summary()  # some mode restores invariance here
        ids = [gen.tokenizer.encode_prompt(p) for p in PROMPTS[:: STRIDE[name]]]
        out[name] = gen, ids, [gen.generate_ids(x, NEW_TOKENS).token_ids for x in ids]
    return out


def test_prompt_set_is_the_benchmark_set():
    assert len(PROMPTS) == 16


@pytest.mark.parametrize("bundle", BUNDLES)
def test_export_measured_an_exact_mode_here(bundles, bundle):
    from specrt.schema.manifest import Manifest
    from tests.export.test_quantize import assert_exact_mode_recorded

    assert_exact_mode_recorded(Manifest.load(bundles[bundle]))


@pytest.mark.covers("lossless")
@pytest.mark.parametrize("bundle,drafter,tree", CASES, ids=[f"{b}-{d}-{t or 'own'}" for b, d, t in CASES])
def test_speculative_greedy_equals_plain(reference, bundle, drafter, tree):
    gen, ids, plain = reference[bundle]
    gen.use(drafter, tree)
    assert gen.drafter_name == drafter, gen.notes
    drafted = 0
    # other shapes: every other prompt, each category (fp32 runs every other one already)
    every = 2 if (drafter, tree) in OTHER_SHAPES and STRIDE[bundle] == 1 else 1
    for i, (x, want) in list(enumerate(zip(ids, plain, strict=True)))[::every]:
        res, want = gen.generate_ids(x, SPECULATED), want[:SPECULATED]
        first = next((j for j, (a, b) in enumerate(zip(res.token_ids, want, strict=False)) if a != b), None)
        assert res.token_ids == want, f"{drafter}/{tree} on {bundle}, prompt {i}: differs from token {first}"
        assert res.lossless
        drafted += res.stats.drafted
    # multi-row verify passes ran (drafts verified, accepted or not): the check is not plain against plain.
    # That drafts are accepted is test_trained_real's τ check (briefly trained drafters are on these
    # unseen prompts accepted rarely; the MTP module on int4 not at all).
    assert drafted > 0


@pytest.mark.parametrize("drafter", ["eagle2", "eagle3"])
def test_dynamic_tree_greedy_equals_plain(reference, bundles, drafter):
    """EAGLE-2's dynamic tree (10 nodes, beam 4), as `--tree-nodes 10 --beam 4` asks for it: the default
    shape is a chain sized to the machine (runtime/shapes.py), so the tree is held to plain output here, on
    every other prompt of the int4 bundle."""
    _, ids, plain = reference["int4"]
    gen = Generator(bundles["int4"], drafter, max_seq_len=512, num_draft_tokens=4, tree_nodes=10, beam=4)
    assert gen.drafter.chosen is None and (gen.drafter.beam, gen.drafter.tree_nodes) == (4, 10)
    for i, (x, want) in list(enumerate(zip(ids, plain, strict=True)))[::2]:
        res = gen.generate_ids(x, SPECULATED)
        assert res.token_ids == want[:SPECULATED], f"{drafter} tree, prompt {i}"
        assert res.stats.drafted > res.stats.steps  # more than one node a step: a tree, not a chain


@pytest.mark.covers("serving")
@pytest.mark.parametrize("bundle,drafter", SERVED, ids=[f"{b}-{d}" for b, d in SERVED])
def test_batched_serving_equals_plain(reference, bundles, bundle, drafter):
    """8 requests (every other prompt: each category) through 4 KV slots: admissions while others run,
    ragged verify passes shared by sequences at different lengths."""
    _, ids, plain = reference[bundle]
    ids, plain = ids[:: 2 // STRIDE[bundle]], plain[:: 2 // STRIDE[bundle]]
    gen = Generator(bundles[bundle], drafter, max_seq_len=512, num_draft_tokens=4, slots=4)
    assert gen.slots == 4 and gen.lossless, gen.notes
    scheduler = Scheduler(gen).start()
    try:
        results = [h.wait() for h in [scheduler.submit(x, NEW_TOKENS) for x in ids]]
    finally:
        scheduler.stop()
    for i, (res, want) in enumerate(zip(results, plain, strict=True)):
        assert res.token_ids == want, f"served {drafter} on {bundle}, request {i}"
    assert max(scheduler.batch_sizes) > 1
    if drafter != "plain":  # the shared passes verified drafts: not plain served against plain
        assert sum(r.stats.drafted for r in results) > 0


@pytest.mark.covers("lossless")
def test_speculation_and_serving_equal_plain_on_an_int8_cache(reference, bundles):
    """`--kv-dtype int8` rounds the target's keys and values to blocks of int8 codes as they are written, so
    the target computes something else than on halves: its own plain output is the reference. EAGLE-3's
    drafts verified on that cache, alone and served in shared ragged passes, give exactly that output."""
    _, ids, halves = reference["int4"]
    ids, halves = ids[::3], halves[::3]  # a third of the prompts: CI's time goes to the default cache
    gen = Generator(bundles["int4"], "plain", max_seq_len=512, num_draft_tokens=4, kv_dtype="int8")
    assert gen.backend == "native" and gen.target.kv_dtype == "int8"
    plain = [gen.generate_ids(x, NEW_TOKENS).token_ids for x in ids]
    assert plain != halves  # the cache is what attention reads: some answer moves
    gen.use("eagle3")
    drafted = 0
    for i, (x, want) in enumerate(zip(ids, plain, strict=True)):
        res = gen.generate_ids(x, NEW_TOKENS)
        assert res.token_ids == want, f"eagle3 on an int8 cache, prompt {i}"
        drafted += res.stats.drafted
    assert drafted > 0
    served = Generator(bundles["int4"], "eagle3", max_seq_len=512, num_draft_tokens=4, slots=4, kv_dtype="int8")
    scheduler = Scheduler(served).start()
    try:
        results = [h.wait() for h in [scheduler.submit(x, NEW_TOKENS) for x in ids]]
    finally:
        scheduler.stop()
    assert [r.token_ids for r in results] == plain and max(scheduler.batch_sizes) > 1
