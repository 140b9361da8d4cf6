"""Medusa: K heads on the target's last hidden state; head k predicts the token k+1 steps ahead.

    head k:  h ─► ResBlock × L (h + SiLU(W h + b)) ─► LM head (the target's, shared; or its own)

Given the hidden state of committed token x[n-1] (whose own logits gave x[n]), head k proposes
x[n+k]. Parameter names follow the public Medusa layout (`medusa_head.{k}.{j}.linear`, own heads
at `medusa_head.{k}.{L}`), so such checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specrt.export.drafters.base import FrozenTargetWeights
from specrt.schema.config import DecoderConfig


@dataclass
class MedusaConfig:
    kind: str = "medusa"
    num_heads: int = 4
    num_layers: int = 1  # residual blocks per head
    own_heads: bool = False  # public Medusa checkpoints carry one LM head per Medusa head


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k ≈ the target's head
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(FrozenTargetWeights):
    def __init__(self, cfg: MedusaConfig, dec: DecoderConfig):
        super().__init__()
        self.cfg, self.dec = cfg, dec
        h, v = dec.hidden_size, dec.vocab_size

        def head():
            blocks = [ResBlock(h) for _ in range(cfg.num_layers)]
            return nn.Sequential(*blocks, *([nn.Linear(h, v, bias=False)] if cfg.own_heads else []))

        self.medusa_head = nn.ModuleList(head() for _ in range(cfg.num_heads))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., K, H]: each head's residual blocks (own LM heads excluded)."""
        n = self.cfg.num_layers
        return torch.stack([head[:n](hidden) for head in self.medusa_head], -2)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits [..., K, V]."""
        feats = self.features(hidden)
        if self.cfg.own_heads:
            return torch.stack([head[-1](feats[..., k, :]) for k, head in enumerate(self.medusa_head)], -2)
        return self.lm_head(feats)
