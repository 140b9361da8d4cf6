"""ONNX Runtime runs the exported graph like our torch module: max |Δlogits| ≤ 1e-3 in fp32 for
prefill, single-token decode and a 6-token verify window; tree masks too."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.export.archs import ARCHS
from specrt.export.bundle import PARITY_TOLERANCE, parity
from specrt.export.decoder_graph import build_decoder_graph
from specrt.export.loading import module_from_hf
from tests.helpers import tiny_hf_model


def save(model, tmp_path):
    path = tmp_path / "decoder.onnx"
    onnx.save_model(model, path, save_as_external_data=True, location="decoder.onnx.data", size_threshold=1024)
    onnx.checker.check_model(str(path), full_check=True)
    return path


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_tiny_family_parity(model_type, tmp_path):
    module = module_from_hf(tiny_hf_model(model_type))
    report = parity(module, save(build_decoder_graph(module), tmp_path))
    assert set(report) == {"prefill", "decode", "verify"}
    assert max(report.values()) <= PARITY_TOLERANCE, report


def test_tree_mask_and_requested_rows(tmp_path):
    """A non-causal tree mask and a subset of logits rows give the torch module's answer."""
    module = module_from_hf(tiny_hf_model("llama"))
    path = save(build_decoder_graph(module), tmp_path)
    ort_model = OrtDecoder(path, module.cfg, 32)
    kv = module.new_kv(1, 32)
    prompt = torch.arange(5, 12)[None]
    causal = torch.tril(torch.ones(7, 7, dtype=torch.bool))[None]
    module(prompt, torch.arange(7)[None], torch.tensor([0]), causal, kv)
    ort_model.run(prompt.numpy(), np.arange(7)[None], np.array([0]), causal.numpy(), np.array([[6]]))
    # tree: root 0 with children 1, 2; node 3 under 1 (paths [0],[0,0],[0,1],[0,0,0])
    parents = [-1, 0, 0, 1]
    mask = torch.zeros(1, 4, 4, dtype=torch.bool)
    for i, p in enumerate(parents):
        mask[0, i, i] = True
        while p >= 0:
            mask[0, i, p] = True
            p = parents[p]
    depth = torch.tensor([[7, 8, 8, 9]])
    ids = torch.tensor([[20, 21, 22, 23]])
    rows = torch.tensor([[3, 0, 2]])
    want, hidden = module(ids, depth, torch.tensor([7]), mask, kv, logits_index=rows)
    got, got_hidden = ort_model.run(ids.numpy(), depth.numpy(), np.array([7]), mask.numpy(), rows.numpy())
    assert got.shape == (1, 3, module.cfg.vocab_size)
    assert np.abs(got - want.numpy()).max() <= PARITY_TOLERANCE
    assert np.abs(got_hidden - hidden.numpy()).max() <= PARITY_TOLERANCE
    # and the tree rule itself: node 2 (sibling of 1) must not see node 1
    alone, _ = module(ids[:, [0, 2]], depth[:, [0, 2]], torch.tensor([7]),
                      torch.tensor([[[True, False], [True, True]]]), kv,
                      logits_index=torch.tensor([[1]]))
    assert torch.allclose(alone[0, 0], want[0, 2], atol=1e-4)


def test_real_bundle_parity(real_bundle, real_model):
    report = parity(real_model.module, real_bundle / "target" / "decoder.onnx")
    assert max(report.values()) <= PARITY_TOLERANCE, report


def test_graph_names_are_hierarchical(tmp_path):
    module = module_from_hf(tiny_hf_model("qwen3"))
    names = [n.name for n in build_decoder_graph(module).graph.node]
    assert len(names) == len(set(names))
    assert "/model/layers.1/self_attn/qkv_proj/MatMul" in names
    assert any(n.startswith("/model/layers.0/self_attn/qk_norm/") for n in names)
