"""The runtime's chat template and tokenization equal transformers' apply_chat_template."""

from __future__ import annotations

import pytest

from specrt.runtime.tokenizer import Tokenizer

PROMPTS = ["Hi", "What is 2+2?", "Write a haiku about the sea.\nMake it calm.", "  leading spaces and ünïcödé ✓"]


@pytest.fixture(scope="module")
def tokenizers(real_bundle):
    from transformers import AutoTokenizer

    from specrt.schema.manifest import Manifest

    ours = Tokenizer(real_bundle, Manifest.load(real_bundle).tokenizer)
    return ours, AutoTokenizer.from_pretrained(real_bundle / "tokenizer")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_prompt_ids_match_transformers(tokenizers, prompt):
    ours, hf = tokenizers
    msgs = [{"role": "user", "content": prompt}]
    want_text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(msgs) == want_text
    want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.encode_prompt(prompt) == list(want)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_raw_prompt_ids_match_transformers(tokenizers, prompt):
    ours, hf = tokenizers
    assert ours.encode_prompt(prompt, raw=True) == hf(prompt)["input_ids"]
    assert ours.decode(ours.encode_prompt(prompt, raw=True)) == hf.decode(hf(prompt)["input_ids"], skip_special_tokens=True)
