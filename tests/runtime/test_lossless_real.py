"""Batch invariance on the real default model (fp32), through the runtime's own passes: a verify
window and a tree node give bitwise the logits and KV rows of plain decoding's one-token passes, in
the execution mode measured for this machine. (Every drafter's output against plain decoding, on
int4 and fp32 bundles, is tests/runtime/test_lossless_every_drafter.py.)
"""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

PROMPTS = [json.loads(line) for line in
           (resources.files("specrt") / "data" / "bench_prompts.jsonl").read_text().splitlines()]


def test_prompt_set_is_diverse():
    cats = {p["category"] for p in PROMPTS}
    assert len(PROMPTS) >= 8 and {"code", "chat", "rewrite", "maths"} <= cats


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
    many = a.forward(window_ids, len(prompt) - 1)["logits"][0]
    singles = np.stack([b.forward([tok], len(prompt) - 1 + i)["logits"][0, 0] for i, tok in enumerate(window_ids)])
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
        runs.append(g.forward(tokens, len(prompt) - 1, parents)["logits"][0])
    tree_logits, chain_logits = runs
    assert np.array_equal(tree_logits[[0, 2, 3]], chain_logits), np.abs(tree_logits[[0, 2, 3]] - chain_logits).max()


def test_chunked_prefill_is_bitwise_equal_to_one_pass(real_generator):
    """A long prompt is prefilled in chunks (runtime/sequence.py): the first token's logits and every KV
    row equal a one-pass prefill of the same prompt, bit for bit, in this machine's execution mode."""
    from specrt.runtime.generate import Generator

    gen = real_generator
    text = " ".join(p["prompt"] for p in PROMPTS)
    prompt = gen.tokenizer.encode_prompt(text)[:300]
    runs = []
    for chunk in (len(prompt), 128, 97):  # one pass; chunks of 128 (last 44); odd chunks (last 9)
        g = Generator(gen.bundle, max_seq_len=512, threads=gen.threads)
        passes = g.sequence(prompt, 1).prefill_passes(chunk)
        for p in passes:
            outs = g.run_pass(p)
        runs.append(([len(p.window) for p in passes], outs["logits"][0],
                     [b[:, :, : len(prompt)].copy() for b in g.target.kv]))
    assert [r[0] for r in runs] == [[300], [128, 128, 44], [97, 97, 97, 9]]
    (_, logits, kv), *others = runs
    for _, other_logits, other_kv in others:
        assert np.array_equal(other_logits, logits), np.abs(other_logits - logits).max()
        assert all(np.array_equal(a, b) for a, b in zip(kv, other_kv, strict=True))
