"""Medusa: K heads on the target's last hidden state; head k predicts the token k+1 steps ahead.

    head k:  h ─► ResBlock × L (h + SiLU(W h + b)) ─► LM head (the target's, shared; or its own)

Given the hidden state of committed token x[n-1] (whose own logits gave x[n]), head k proposes
x[n+k]. Parameter names follow the public Medusa layout (`medusa_head.{k}.{j}.linear`, own heads
at `medusa_head.{k}.{L}`), so such checkpoints load as they are.

The kind's code, all here: the module, its graph (no KV)

    medusa/medusa.onnx   hidden_in [B,R,H] ─► logits [B,R,K,V]   and the static tree stored with it,

its objective (head k on h[t]: CE(p[t+k]), weights 0.8^k), and the public FasterDecoding/Medusa
layout: config.json (medusa_num_heads, medusa_num_layers) and medusa_lm_head.safetensors / .pt
with `{k}.{j}.linear.*` and own heads `{k}.{L}.weight` (or a full Medusa-2 model whose weights
hold `medusa_head.*`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specrt.errors import SpecrtError
from specrt.export.decoder_graph import _np
from specrt.export.drafter_export import save_graph, session_parity, vocab_ids_entry
from specrt.export.drafters import make_config
from specrt.export.drafters.base import FrozenTargetWeights
from specrt.export.drafters.public import CONFIG, MODEL_FILES, PublicLayout, build_for, fill, ignored
from specrt.export.training.objectives import Objective, shift_rows, soft_ce, top1_hits
from specrt.plugins.onnx_builder import FLOAT, GraphBuilder
from specrt.schema.config import DecoderConfig

# Medusa-style "choices": more candidates near the root, where the heads are more often right.
MEDUSA_TREE = [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_lm_head.bin")


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

    def head_weights(self) -> list[torch.Tensor]:
        """Each Medusa head's LM-head rows [V', H] of the draft vocabulary (`head_rows`)."""
        if self.cfg.own_heads:
            return [self.head_rows(head[-1].weight) for head in self.medusa_head]
        return [self.head_rows(self.lm_head.weight)] * self.cfg.num_heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> logits [..., K, V'] over the draft vocabulary, as the graph computes them."""
        feats = self.features(hidden)
        return torch.stack([F.linear(feats[..., k, :], w) for k, w in enumerate(self.head_weights())], -2)


# ---------------------------------------------------------------------------------------------- export


def medusa_tree(num_heads: int) -> list[list[int]]:
    return [p for p in MEDUSA_TREE if len(p) <= num_heads]


def medusa_graph(module: MedusaHeads, name: str = "medusa"):
    g = GraphBuilder(name)
    cfg, dec = module.cfg, module.dec
    heads = module.head_weights()
    h, v = dec.hidden_size, heads[0].shape[0]
    hidden = g.input("hidden_in", FLOAT, ["batch", "rows", h])
    feats = []
    for k, head in enumerate(module.medusa_head):
        x = hidden
        with g.scope(f"medusa_head.{k}"):
            for j in range(cfg.num_layers):
                lin = head[j].linear
                y = g.op("Add", g.op("MatMul", x, g.weight(f"medusa_head.{k}.{j}.linear.weight", _np(lin.weight).T)),
                         g.weight(f"medusa_head.{k}.{j}.linear.bias", _np(lin.bias)))
                x = g.op("Add", x, g.op("Mul", y, g.op("Sigmoid", y)))
        feats.append(g.op("Unsqueeze", x, g.const([2])))
    stacked = g.op("Concat", *feats, axis=2)  # [B, R, K, H]
    if cfg.own_heads:
        w = np.stack([_np(weight).T for weight in heads])  # [K, H, V']
        per_head = g.op("Transpose", stacked, perm=[2, 0, 1, 3])  # [K, B, R, H]
        logits = g.op("Transpose", g.op("MatMul", g.op("Reshape", per_head, g.const([cfg.num_heads, -1, h])),
                                        g.weight("medusa_head.lm_heads", w)), perm=[1, 0, 2])  # [B·R, K, V]
        logits = g.op("Reshape", logits, g.op("Concat", g.op("Shape", hidden, end=2), g.const([cfg.num_heads, v]),
                                              axis=0))
    else:
        logits = g.op("MatMul", stacked, g.weight("lm_head.weight", _np(heads[0]).T))
    g.output(logits, "logits", FLOAT, ["batch", "rows", cfg.num_heads, v])
    return g.model(doc=f"specrt Medusa heads ({cfg.num_heads})")


def medusa_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """medusa/medusa.onnx, the static tree stored with it, and medusa/vocab_ids.npy where the heads cover a
    draft vocabulary."""
    graphs = {"medusa": save_graph(medusa_graph(module), tmp / "medusa" / "medusa.onnx", "medusa", target_cfg, source)}
    parity = {}
    if check_parity:
        h = torch.randn(1, 2, target_cfg.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            parity["medusa"] = session_parity(tmp / graphs["medusa"].file, {"hidden_in": h}, module(h))
    entry = {"tree": medusa_tree(module.cfg.num_heads), **vocab_ids_entry(module.head_vocab, tmp, "medusa")}
    return graphs, entry, parity


# ---------------------------------------------------------------------------------------------- training


class MedusaObjective(Objective):
    """Head k on h[t]: CE(p[t+k]), weights 0.8^k."""

    def __call__(self, batch):
        feats = self.m.features(batch.hidden)  # [B,T,K,H]
        loss, hits = 0.0, []
        for k in range(self.m.cfg.num_heads):
            if self.m.cfg.own_heads:
                w = self.m.medusa_head[k][-1].weight[self.vocab]
            else:
                w = self.sub_weight(self.m.lm_head.weight)
            logits = F.linear(feats[:, :, k], w)
            ids, p = shift_rows(batch.label_ids, k + 1), shift_rows(batch.label_p, k + 1)
            mask = shift_rows(batch.valid, k + 1)
            loss = loss + 0.8**k * soft_ce(logits, ids, p, mask)
            hits.append(top1_hits(logits, shift_rows(batch.label_top, k + 1), mask & shift_rows(batch.answer, k + 1)))
        return loss, hits


# ---------------------------------------------------------------------------------------------- public layout


PUBLIC = PublicLayout("Medusa (medusa_lm_head.*)",
                      lambda p: "medusa_num_heads" in p.meta or p.first(MEDUSA_FILES) is not None,
                      weight_files=MEDUSA_FILES + MODEL_FILES, wanted=MEDUSA_FILES)


def load_medusa(folder: Path, meta: dict, weights, target):
    src = weights.path
    keys = [k for k in weights.keys() if not ignored(k)]
    full_model = not src.name.startswith("medusa_lm_head")
    prefix = "medusa_head." if full_model or any(k.startswith("medusa_head.") for k in keys) else ""
    if full_model:
        keys = [k for k in keys if k.startswith(prefix)]
    parsed = [re.match(r"(\d+)\.(\d+)\.", k[len(prefix):]) for k in keys]
    if not keys or not all(parsed):
        bad = [k for k, m in zip(keys, parsed, strict=True) if not m][:4]
        raise SpecrtError(f"{src} holds no Medusa heads ({{k}}.{{j}}.linear.weight) {bad or ''}: pass the folder "
                          "with medusa_lm_head.safetensors / .pt")
    num_heads = int(meta.get("medusa_num_heads") or 1 + max(int(m[1]) for m in parsed))
    num_layers = meta.get("medusa_num_layers")
    if num_layers is None:
        num_layers = sum(1 for k in keys if re.fullmatch(r"0\.\d+\.linear\.weight", k[len(prefix):]))
    num_layers = int(num_layers)
    own_heads = any(k[len(prefix):] == f"{h}.{num_layers}.weight" for k in keys for h in range(num_heads))
    module = build_for(make_config("medusa", num_heads=num_heads, num_layers=num_layers, own_heads=own_heads), target)
    fill(module, weights, keys, lambda k: prefix + k.removeprefix("medusa_head."),
         f"Medusa ({num_heads} heads × {num_layers} layers, from {folder / CONFIG})")
    return module
