"""Our compact decoder equals transformers' own forward pass: tiny random configs of every family,
and the real default model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specrt.export.archs import ARCHS
from specrt.export.loading import module_from_hf
from specrt.export.modeling import DecoderLM
from tests.helpers import FAMILY_OVERRIDES, tiny_hf_model


def causal(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool))[None]


def test_every_family_has_a_tiny_config():
    assert set(FAMILY_OVERRIDES) == set(ARCHS), "add a tiny config for each supported family to tests/helpers.py"


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_prefill_and_cached_decode_match_transformers(model_type):
    hf = tiny_hf_model(model_type)
    ours = module_from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    kv = ours.new_kv(1, 32)
    got, _ = ours(ids, torch.arange(14)[None], torch.tensor([0]), causal(14), kv)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4, f"prefill max |Δ| {(got - want).abs().max().item():.2e}"

    # prefill 8 tokens, then a 6-token verify window against the cache: same logits as full prefill
    kv = ours.new_kv(1, 32)
    ours(ids[:, :8], torch.arange(8)[None], torch.tensor([0]), causal(8), kv)
    got, _ = ours(ids[:, 8:], torch.arange(8, 14)[None], torch.tensor([8]), causal(6), kv)
    diff = (got - want[:, 8:]).abs().max().item()
    assert diff < 1e-4, f"cached verify max |Δ| {diff:.2e}"


def test_qwen2_biases_and_qwen3_qk_norm_are_used():
    """Guards the registry: dropping a family's distinctive part must break parity."""
    for model_type, param in (("qwen2", "q_proj.bias"), ("qwen3", "q_norm.weight")):
        hf = tiny_hf_model(model_type)
        ours = module_from_hf(hf)
        ids = torch.arange(10)[None]
        with torch.no_grad():
            want = hf(ids).logits
            for name, p in ours.named_parameters():
                if name.endswith(param):
                    p.mul_(0.0)
        got, _ = ours(ids, torch.arange(10)[None], torch.tensor([0]), causal(10), ours.new_kv(1, 16))
        assert (got - want).abs().max().item() > 1e-3, f"{model_type}: {param} has no effect"


# (family, DecoderConfig field, a value that drops it): each is Gemma maths the registry must carry
GEMMA_MATHS = [("gemma", "embed_scale", 1.0), ("gemma", "activation", "silu"),
               ("gemma2", "sandwich_norms", False), ("gemma2", "query_pre_attn_scalar", 0.0),
               ("gemma2", "attn_logit_softcapping", 0.0), ("gemma2", "final_logit_softcapping", 0.0),
               ("gemma3_text", "layer_rope", ()), ("gemma3_text", "final_logit_softcapping", 0.0)]


@pytest.mark.parametrize(("model_type", "name", "dropped"), GEMMA_MATHS, ids=[f"{m}-{n}" for m, n, _ in GEMMA_MATHS])
def test_gemma_maths_is_used(model_type, name, dropped):
    """The family's config value is honoured: without it our logits leave transformers' (a guard on
    the tiny configs of tests/helpers.py, whose values are chosen to bite)."""
    hf = tiny_hf_model(model_type)
    ours = module_from_hf(hf)
    assert getattr(ours.cfg, name) != dropped, f"{model_type}: {name} is not read from the config"
    ids = torch.arange(3, 13)[None]
    with torch.no_grad():
        want = hf(ids).logits
    cut = DecoderLM(replace(ours.cfg, **{name: dropped}))
    cut.load_state_dict(ours.state_dict(), strict=False)  # sandwich_norms=False: its two norms are unused
    got, _ = cut(ids, torch.arange(10)[None], torch.tensor([0]), causal(10), cut.new_kv(1, 16))
    assert (got - want).abs().max().item() > 1e-3, f"{model_type}: {name} has no effect"


def test_real_model_matches_transformers(real_model):
    ids = torch.tensor([[1, 504, 8572, 8159, 260, 725, 6050, 990, 253, 986, 6866, 30, 2]])
    with torch.no_grad():
        want = real_model.hf_model(ids).logits
    got, _ = real_model.module(ids, torch.arange(ids.shape[1])[None], torch.tensor([0]), causal(ids.shape[1]),
                               real_model.module.new_kv(1, 32))
    diff = (got - want).abs().max().item()
    assert diff < 1e-3, f"real model max |Δlogits| {diff:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))
