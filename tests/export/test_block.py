"""The block drafter's training pass is the run-time pass: for every anchor row and depth, the logits
training computes (all anchors at once, `block_mask`) equal a from-scratch causal pass over the
anchor's committed rows followed by its mask rows — what the runtime feeds the ONNX graph."""

from __future__ import annotations

import pytest
import torch

from specrt.export import drafters
from specrt.export.drafters.block import MASK_ID, block_logits, block_mask
from specrt.export.loading import module_from_hf
from tests.export.test_drafters import randomized
from tests.helpers import tiny_hf_model


@pytest.fixture(scope="module")
def target():
    return module_from_hf(tiny_hf_model("llama", seed=3))


@pytest.fixture(scope="module")
def block(target):
    cfg = drafters.make_config("block", taps=[0, 1], draft_vocab_size=50, block_size=3)
    return randomized(drafters.build(cfg, target), seed=4)


def runtime_pass(module, ids: list[int], feats: torch.Tensor, mask_rows: int) -> torch.Tensor:
    """Logits of a causal pass over committed rows `ids`/`feats` and `mask_rows` mask rows, empty cache."""
    n = len(ids) + mask_rows
    all_ids = torch.tensor([[*ids, *[MASK_ID] * mask_rows]])
    all_feats = torch.cat([feats, torch.zeros(mask_rows, feats.shape[1])])[None]
    logits, _ = module.step(all_ids, all_feats, torch.arange(n)[None], torch.tensor([0]),
                            torch.tril(torch.ones(n, n, dtype=torch.bool))[None], module.new_kv(1, n + 1))
    return logits[0]


def test_training_logits_equal_the_runtime_pass(block):
    gen = torch.Generator().manual_seed(0)
    rows, k = 9, block.cfg.block_size
    ids = torch.randint(0, block.dec.vocab_size, (1, rows), generator=gen)
    real = torch.randn(1, rows, block.dec.hidden_size, generator=gen)
    with torch.no_grad():
        train = block_logits(block, ids, real)[0]  # [k·rows, V']
    for anchor in (0, 4, rows - 1):
        run = runtime_pass(block, ids[0, : anchor + 1].tolist(), real[0, : anchor + 1], k - 1)
        for depth in range(k):  # depth+1: the anchor row itself, then mask row `depth`
            torch.testing.assert_close(train[depth * rows + anchor], run[anchor + depth], atol=1e-4, rtol=1e-4)


def test_mask_rows_see_only_their_anchor():
    m = block_mask(4, 3)
    assert m.shape == (12, 12)
    assert torch.equal(m[:4, :4], torch.tril(torch.ones(4, 4, dtype=torch.bool))) and not m[:4, 4:].any()
    row = m[2 * 4 + 1]  # depth 3 of anchor 1: real rows 0..1, the anchor's depth-2 and depth-3 rows
    assert row.nonzero().flatten().tolist() == [0, 1, 4 + 1, 8 + 1]
