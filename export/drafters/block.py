"""One-pass block drafter (P-EAGLE / DFlash style): the whole draft block in one layer pass.

EAGLE-3 drafts depth d from its own output at depth d-1, one pass per depth. Here the rows after
the newest committed one are *mask rows*: a learned token embedding and a learned feature stand in
for the tokens not drafted yet, so all K depths come out of one pass over

    committed rows (token x[r+1], fused target feature g[r])  …  row m-1 ─► x[m+1]
    mask rows m, m+1, …, m+K-2 (mask_embed, mask_hidden)         ─► x[m+2], …, x[m+K]

with causal attention over the window (mask row j sees the committed rows and the mask rows
before it). The layer, fusion, norms, reduced vocabulary and head are EAGLE-3's; the kind adds
`mask_embed` and `mask_hidden`. In the ONNX graph an input id < 0 marks a mask row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specrt.export.drafters.eagle import Eagle3Head
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


def block_warm_start(module: BlockHead, target, vocab: torch.Tensor) -> None:
    """EAGLE-3's warm start; the mask embedding starts as the mean token embedding."""
    from specrt.export.drafters.eagle import eagle3_warm_start

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
    from specrt.export.modeling import rope_cos_sin

    k, rows = module.cfg.block_size, ids.shape[1]
    stacked_ids = torch.cat([ids] + [torch.full_like(ids, MASK_ID)] * (k - 1), 1)
    stacked = torch.cat([real] + [torch.zeros_like(real)] * (k - 1), 1)
    cos, sin = rope_cos_sin(module.dec, torch.cat([torch.arange(rows) + j for j in range(k)])[None])
    out, _ = module.layer_train(stacked_ids, stacked, cos, sin, [], block_mask(rows, k))
    return module.head(out)
