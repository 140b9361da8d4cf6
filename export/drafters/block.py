"""One-pass block drafter (P-EAGLE / DFlash style): the whole draft block in one layer pass.

EAGLE-3 drafts depth d from its own output at depth d-1, one pass per depth. Here the rows after
the newest committed one are *mask rows*: a learned token embedding and a learned feature stand in
for the tokens not drafted yet, so all K depths come out of one pass over

    committed rows (token x[r+1], fused target feature g[r])  …  row m-1 ─► x[m+1]
    mask rows m, m+1, …, m+K-2 (mask_embed, mask_hidden)         ─► x[m+2], …, x[m+K]

with causal attention over the window (mask row j sees the committed rows and the mask rows
before it). The layer, fusion, norms, reduced vocabulary and head are EAGLE-3's; the kind adds
`mask_embed` and `mask_hidden`. In the ONNX graph an input id < 0 marks a mask row.

The kind's code, all here: the module, its graph mix, its graphs (block/layer.onnx, block/fuse.onnx,
block/vocab_ids.npy: EAGLE-3's layout, and a static tree), its objective and warm start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specrt.export.drafters.eagle3 import Eagle3Head, eagle3_warm_start, fused_layer_graphs
from specrt.export.drafters.medusa import medusa_tree
from specrt.export.modeling import rope_cos_sin
from specrt.export.training.objectives import Objective, shift_rows, soft_ce, top1_hits
from specrt.schema.config import DecoderConfig

MASK_ID = -1  # input id of a mask row (graph and runtime)


@dataclass
class BlockConfig:
    kind: str = "block"
    block_size: int = 4  # tokens drafted per pass (depth 1 from the newest committed row, K-1 mask rows)
    taps: list[int] = field(default_factory=list)  # target layers whose inputs are fused (EAGLE-3's)
    draft_vocab_size: int = 0  # 0: the target's vocabulary
    head_from_target: bool = False  # as EAGLE-3's: the target's rows of the draft vocabulary, not stored


class BlockHead(Eagle3Head):
    def __init__(self, cfg: BlockConfig, dec: DecoderConfig):
        super().__init__(cfg, dec)
        h = dec.hidden_size
        self.mask_embed = nn.Parameter(torch.randn(h) * 0.02)
        self.mask_hidden = nn.Parameter(torch.randn(h) * 0.02)

    def mix(self, input_ids, hidden):
        masked = (input_ids < 0)[..., None]
        e = torch.where(masked, self.mask_embed, self.embed_tokens(input_ids.clamp(min=0)))
        h = torch.where(masked, self.mask_hidden, hidden.to(self.mask_hidden.dtype))
        return torch.cat([self.midlayer.input_layernorm(e), self.midlayer.hidden_norm(h)], -1), h

    def graph_mix(self, fg, ids: str, hidden: str):
        """EAGLE-3's mix, with mask rows (id < 0) reading the learned mask embedding and feature:

            masked = ids < 0 ─► Where(masked, mask_embed, inputs_embeds)   (the target's rows of max(ids, 0))
                             └► Where(masked, mask_hidden, hidden_in)
        """
        g = fg.named("midlayer").g
        masked = g.op("Unsqueeze", g.op("Less", ids, g.const([0])), g.const([-1]), name="mask_rows")
        e = g.op("Where", masked, fg.weight_of("mask_embed", self.mask_embed), fg.embed(ids))
        h = g.op("Where", masked, fg.weight_of("mask_hidden", self.mask_hidden), hidden)
        e = fg.norm(e, self.midlayer.input_layernorm, "input_layernorm")
        return g.op("Concat", e, fg.norm(h, self.midlayer.hidden_norm, "hidden_norm"), axis=-1), h


def block_warm_start(module: BlockHead, target, vocab: torch.Tensor) -> None:
    """EAGLE-3's warm start; the mask embedding starts as the mean token embedding."""
    eagle3_warm_start(module, target, vocab)
    with torch.no_grad():
        module.mask_embed.copy_(target.model.embed_tokens.weight.mean(0))


def block_mask(rows: int, block: int) -> torch.Tensor:
    """Training attention [rows, block·rows]: copy 0 is the real rows (causal); copy j ≥ 1 holds, for
    every anchor row r, the mask row at depth j+1, which sees real rows ≤ r and the anchor's mask
    rows of copies 1..j (itself included) — what a mask row sees at run time."""
    r = torch.arange(rows)[:, None]
    c = torch.arange(rows)[None, :]
    real = c <= r
    blocks = []
    for j in range(block):
        if j == 0:
            blocks.append([real] + [torch.zeros(rows, rows, dtype=torch.bool)] * (block - 1))
        else:
            blocks.append([real] + [(c == r) if 1 <= i <= j else torch.zeros(rows, rows, dtype=torch.bool)
                                    for i in range(1, block)])
    return torch.cat([torch.cat(b, 1) for b in blocks], 0)


def block_logits(module: BlockHead, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Training's one pass over every anchor at once: ids [B,R] (row r reads x[r+1]), fused features
    real [B,R,H] -> logits [B, K·R, V']; rows j·R + r are depth j+1 drafted from anchor r."""
    k, rows = module.cfg.block_size, ids.shape[1]
    stacked_ids = torch.cat([ids] + [torch.full_like(ids, MASK_ID)] * (k - 1), 1)
    stacked = torch.cat([real] + [torch.zeros_like(real)] * (k - 1), 1)
    cos, sin = rope_cos_sin(module.dec, torch.cat([torch.arange(rows) + j for j in range(k)])[None])
    out, _ = module.layer_train(stacked_ids, stacked, cos, sin, [], block_mask(rows, k))
    return module.head(out)


def block_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """block/layer.onnx, block/fuse.onnx, block/vocab_ids.npy (EAGLE-3's layout) and its static tree."""
    graphs, extra, parity = fused_layer_graphs(module, tmp, source, check_parity, "block", target_cfg, mask_rows=2)
    return graphs, {**extra, "tree": medusa_tree(module.cfg.block_size)}, parity


class BlockObjective(Objective):
    """One pass per block: copy 0 holds the real rows, copy j the mask rows at depth j+1 of every anchor
    (`block_mask`); copy j row r predicts p[r+j+1]. Labels in the draft vocabulary, as EAGLE-3."""

    def __call__(self, batch):
        k = self.m.cfg.block_size
        rows = batch.T - 1
        ids = batch.tokens[:, 1:]
        lab_ids, lab_p, lab_top = batch.label_ids[:, 1:], batch.label_p[:, 1:], batch.label_top[:, 1:]
        valid, answer = batch.valid[:, 1:], batch.answer[:, 1:]
        logits = block_logits(self.m, ids, self.m.fuse(batch.aux)[:, :rows])
        loss, hits = 0.0, []
        for j in range(k):
            part = logits[:, j * rows : (j + 1) * rows]
            ok = shift_rows(valid, j) & valid
            loss = loss + soft_ce(part, shift_rows(lab_ids, j), shift_rows(lab_p, j), ok)
            hits.append(top1_hits(part, shift_rows(lab_top, j), ok & shift_rows(answer, j)))
        return loss / k, hits
