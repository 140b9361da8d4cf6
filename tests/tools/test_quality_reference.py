"""`validate --quality`'s reference: the prompts' greedy answers decoded as one batch are each prompt's own,
token for token, with the same log-probabilities as decoding it alone (ragged prompt lengths; a family whose
sliding window is shorter than the answers too)."""

from __future__ import annotations

import pytest
import torch

from specrt.export.loading import module_from_hf
from specrt.tools.quality import greedy_references
from tests.helpers import tiny_hf_model


def _alone(module, ids: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
    """One prompt, one cached row a step: the way the reference was first written."""
    with torch.no_grad():
        t = len(ids)
        kv = module.new_kv(1, t + tokens)
        out, _ = module(torch.tensor([ids]), torch.arange(t)[None], torch.tensor([0]),
                        torch.tril(torch.ones(t, t, dtype=torch.bool))[None], kv)
        rows, ids = [out[0]], [*ids, int(out[0, -1].argmax())]
        for _ in range(tokens - 1):
            t = len(ids) - 1
            out, _ = module(torch.tensor([[ids[-1]]]), torch.tensor([[t]]), torch.tensor([t]),
                            torch.ones(1, 1, 1, dtype=torch.bool), kv)
            rows.append(out[0])
            ids.append(int(out[0, -1].argmax()))
    return ids, torch.cat(rows).double().log_softmax(-1)


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("gemma3_text", {"sliding_window": 8})])
def test_batched_reference_answers_are_each_prompts_own(family, overrides):
    module = module_from_hf(tiny_hf_model(family, seed=3, **overrides))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, module.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 6, 1)]
    tokens = 12
    got = greedy_references(module, prompts, tokens)
    assert len(got) == len(prompts)
    for prompt, (ids, logp) in zip(prompts, got, strict=True):
        want_ids, want_logp = _alone(module, prompt, tokens)
        assert ids == want_ids and len(ids) == len(prompt) + tokens
        assert logp.shape == (len(prompt) + tokens - 1, module.cfg.vocab_size)
        torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=0)
