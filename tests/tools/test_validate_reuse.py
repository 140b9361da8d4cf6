"""`validate --lossless` prefills its prompt once: later samples must be what a fresh prefill gives."""

from __future__ import annotations

import pytest

from specrt.runtime.generate import Generator
from specrt.runtime.sampling import SamplingParams
from specrt.tools.validate import PromptReuse


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "block"])
def test_reused_prefill_generates_what_a_fresh_prefill_does(random_drafters_bundle, drafter):
    gen = Generator(random_drafters_bundle[0], drafter, max_seq_len=64, allow_inexact=True)
    prompt = gen.tokenizer.encode_prompt("red, green, blue, red, green, blue, red")
    runs = [SamplingParams(1.0, 4, 1.0, seed=s) for s in range(4)] + [SamplingParams(temperature=0.0)]
    reuse = PromptReuse(gen)
    reused = [reuse.generate(prompt, 8, p) for p in runs]  # one prefill, then four reuses in a row
    for params, got in zip(runs, reused, strict=True):
        want = gen.generate_ids(prompt, 8, params)
        assert got.token_ids == want.token_ids, (drafter, params)
        assert (got.stats.steps, got.stats.accepted) == (want.stats.steps, want.stats.accepted), (drafter, params)
