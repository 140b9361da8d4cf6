"""Lossless on the real default model: greedy speculative output equals plain greedy output.

Design property behind it: the ONNX Runtime CPU graph is batch-invariant in the token window — one
k-token verify pass gives bitwise the logits of k single-token passes (tested below), so chain
verification can only reproduce plain decoding. Should a divergence ever appear, the test demands
proof that it is a floating-point tie (top-2 logit gap below TIE_BOUND) and fails otherwise.
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

TIE_BOUND = 1e-4  # a top-2 logit gap smaller than this is a floating-point tie in fp32 at these magnitudes
PROMPTS = [json.loads(line) for line in
           (resources.files("specrt") / "data" / "bench_prompts.jsonl").read_text().splitlines()]


def test_prompt_set_is_diverse():
    cats = {p["category"] for p in PROMPTS}
    assert len(PROMPTS) >= 8 and {"code", "chat", "rewrite", "maths"} <= cats


def top2_gap(gen, ids: list[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after `ids` (fresh plain pass)."""
    from specrt.runtime.generate import Generator

    fresh = Generator(gen.bundle, max_seq_len=gen.capacity, threads=gen.threads)
    logits = fresh.forward(ids, 0, rows=[len(ids) - 1])[0]
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


TWO_PER_CATEGORY = [p for p in PROMPTS if p["id"].endswith(("-1", "-2"))]


@pytest.mark.slow
@pytest.mark.parametrize("drafter,tree,prompts", [("ngram", None, PROMPTS), ("draft", None, PROMPTS),
                                                  ("ngram", "default", PROMPTS),
                                                  ("draft", "default", TWO_PER_CATEGORY)],
                         ids=["ngram-chain", "draft-chain", "ngram-tree", "draft-tree"])
def test_speculative_greedy_equals_plain_greedy(real_generator, drafter, tree, prompts):
    gen = real_generator
    report = []
    assert len(prompts) >= 8
    for p in prompts:
        ids = gen.tokenizer.encode_prompt(p["prompt"])
        plain = gen.use("plain").generate_ids(ids, 64)
        spec = gen.use(drafter, tree).generate_ids(ids, 64)
        assert plain.stats.new_tokens >= 8, f"{p['id']}: too short to be meaningful"
        if spec.token_ids != plain.token_ids:
            i = next((j for j, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids, strict=False)) if a != b),
                     min(len(spec.token_ids), len(plain.token_ids)))
            gap = top2_gap(gen, ids + plain.token_ids[:i])
            assert gap < TIE_BOUND, (f"{drafter} diverged from plain on {p['id']} at token {i} with top-2 gap "
                                     f"{gap:.3e} ≥ {TIE_BOUND}: not a floating-point tie")
            report.append((p["id"], i, gap))
        else:
            assert spec.finish_reason == plain.finish_reason
        assert spec.stats.steps <= plain.stats.steps
    assert not report, f"divergences (all proven ties): {report}"  # none expected: the graph is batch-invariant


@pytest.mark.slow
def test_ngram_accepts_drafts_on_a_rewrite_prompt(real_generator):
    gen = real_generator.use("ngram")
    ids = gen.tokenizer.encode_prompt(next(p for p in PROMPTS if p["id"] == "rewrite-4")["prompt"])
    res = gen.generate_ids(ids, 64)
    assert res.stats.accepted > 0 and res.stats.mean_accepted_len > 1.5


@pytest.mark.parametrize("window", [2, 4, 6, 9])
def test_verify_window_is_bitwise_equal_to_single_token_passes(real_generator, window):
    """The batch-invariance the lossless guarantee rests on (ONNX Runtime CPU, fp32)."""
    from specrt.runtime.generate import Generator

    gen = real_generator
    prompt = gen.tokenizer.encode_prompt("Count from one to twenty.")
    cont = gen.use("plain").generate_ids(prompt, window).token_ids
    a = Generator(gen.bundle, max_seq_len=256, threads=gen.threads)
    b = Generator(gen.bundle, max_seq_len=256, threads=gen.threads)
    a.forward(prompt, 0, rows=[len(prompt) - 1])
    b.forward(prompt, 0, rows=[len(prompt) - 1])
    window_ids = [prompt[-1], *cont[: window - 1]]
    # the window re-feeds the last prompt token (as the runtime does), then the continuation
    many = a.forward(window_ids, len(prompt) - 1)
    singles = np.stack([b.forward([tok], len(prompt) - 1 + i)[0] for i, tok in enumerate(window_ids)])
    assert np.array_equal(many, singles), f"max |Δ| {np.abs(many - singles).max():.3e}"
    for buf_a, buf_b in zip(a.target.kv, b.target.kv, strict=True):
        rows = slice(0, len(prompt) - 1 + window)
        assert np.array_equal(buf_a[:, :, rows], buf_b[:, :, rows])


def test_tree_branch_logits_are_bitwise_equal_to_a_chain(real_generator):
    """A node on the 2nd branch of a tree sees its context through permuted columns (see
    specrt::TreeAttention); its logits must be bitwise those of the same tokens verified as a chain."""
    from specrt.runtime.generate import Generator
    from specrt.runtime.tree import Tree

    gen = real_generator
    prompt = gen.tokenizer.encode_prompt("Name three colours.")
    cont = gen.use("plain").generate_ids(prompt, 4).token_ids
    tree = Tree.from_parents([-1, 0, 0, 2, 0])  # root, wrong sibling, cont[0], cont[1] (child), another sibling
    window = [prompt[-1], (cont[0] + 7) % 1000, cont[0], cont[1], (cont[0] + 9) % 1000]
    runs = []
    for tokens, parents in ((window, tree), ([prompt[-1], cont[0], cont[1]], Tree.chain(2))):
        g = Generator(gen.bundle, max_seq_len=256, threads=gen.threads)
        g.forward(prompt, 0, rows=[len(prompt) - 1])
        runs.append(g.forward(tokens, len(prompt) - 1, parents))
    tree_logits, chain_logits = runs
    assert np.array_equal(tree_logits[[0, 2, 3]], chain_logits), np.abs(tree_logits[[0, 2, 3]] - chain_logits).max()
