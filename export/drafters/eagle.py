"""EAGLE-1/2 and EAGLE-3 heads: one decoder layer that drafts over features autoregressively.

EAGLE-1/2 (`eagle`): row r fuses the next token's embedding with a feature vector,

    fc(concat(embed(x[r+1]), f[r])) ─► decoder layer ─► f'[r] ─► the target's LM head ─► x[r+2]

where f is the target's last hidden state for committed rows and the head's own output for
drafted rows (trained to regress the target's next hidden state). EAGLE-2 differs only at run
time (a dynamic tree), so both share these weights.

EAGLE-3 (`eagle3`): the target's low / middle / high layer features are fused first,
g = fc(concat(a_low, a_mid, a_high)); the layer's attention reads concat(norm(embed(x)), norm(g))
(2H wide), its output feeds the next drafted row directly, and logits come from its own norm + LM
head over a reduced draft vocabulary (`d2t`: target id = draft id + d2t[draft id]).

Parameter names follow the public EAGLE / EAGLE-3 layouts (`fc`, `layers.0.*` / `midlayer.*`,
`norm`, `lm_head`, `d2t`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from specrt.export.drafters.base import FeatureDrafter, one_layer
from specrt.export.modeling import MLP, Attention, DecoderLayer, RMSNorm
from specrt.schema.config import DecoderConfig


@dataclass
class EagleConfig:
    kind: str = "eagle"
    fc_bias: bool = True
    input_norm: bool = False  # EAGLE-1 checkpoints drop input_layernorm in their only layer


@dataclass
class Eagle3Config:
    kind: str = "eagle3"
    taps: list[int] = field(default_factory=list)  # target layers whose *inputs* are fused
    draft_vocab_size: int = 0  # 0: the target's vocabulary
    # the head is the target's LM-head rows of the draft vocabulary, frozen, and not stored: a checkpoint
    # keeps d2t and slices the rows from the target when it loads (specrt's own training does this)
    head_from_target: bool = False


def default_taps(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high choice: inputs of layers 2, L/2 and L-3."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)})


class EagleHead(FeatureDrafter):
    def __init__(self, cfg: EagleConfig, dec: DecoderConfig):
        super().__init__()
        self.cfg, self.dec = cfg, one_layer(dec)
        h = dec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=cfg.fc_bias)
        layer = DecoderLayer(self.dec)
        if not cfg.input_norm:
            layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])

    @property
    def layer(self):
        return self.layers[0]

    def mix(self, input_ids, hidden):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden.to(self.fc.weight.dtype)], -1))
        return self.layer.input_layernorm(x), x


class Eagle3Layer(nn.Module):
    def __init__(self, dec: DecoderConfig):
        super().__init__()
        h = dec.hidden_size
        self.hidden_norm = RMSNorm(h, dec.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, dec.rms_norm_eps)
        self.self_attn = Attention(dec, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, dec.rms_norm_eps)
        self.mlp = MLP(dec)


class Eagle3Head(FeatureDrafter):
    def __init__(self, cfg: Eagle3Config, dec: DecoderConfig):
        super().__init__()
        self.cfg, self.dec = cfg, one_layer(dec)
        h = dec.hidden_size
        vocab = cfg.draft_vocab_size or dec.vocab_size
        self.fc = nn.Linear(len(cfg.taps) * h, h, bias=False)
        self.midlayer = Eagle3Layer(self.dec)
        self.norm = RMSNorm(h, dec.rms_norm_eps)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.int64))  # target id - draft id
        if cfg.head_from_target:
            self.lm_head.weight.requires_grad_(False)

    @property
    def layer(self):
        return self.midlayer

    def trainable_state(self) -> dict[str, torch.Tensor]:
        state = super().trainable_state()
        return {k: v for k, v in state.items() if k != "lm_head.weight"} if self.cfg.head_from_target else state

    def attach_head(self, target) -> None:
        """With `head_from_target`: the head becomes the target's rows of the draft vocabulary (d2t)."""
        if self.cfg.head_from_target:
            with torch.no_grad():
                self.lm_head.weight.copy_(target.lm_head.weight[self.target_ids()])

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """Target features [.., len(taps)*H] -> the layer's hidden input [.., H]."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def mix(self, input_ids, hidden):
        e = self.midlayer.input_layernorm(self.embed_tokens(input_ids))
        return torch.cat([e, self.midlayer.hidden_norm(hidden)], -1), hidden

    def head_input(self, out):
        return self.norm(out)

    def target_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t


def eagle3_options(options: dict, data, vocab: torch.Tensor) -> dict:
    """EAGLE-3 reads the target layers the distillation data recorded, over the label vocabulary; its head
    is the target's rows of that vocabulary unless `head_from_target` is set false."""
    return {"head_from_target": True, **options, "taps": list(data.taps), "draft_vocab_size": len(vocab)}


def eagle3_warm_start(module: Eagle3Head, target, vocab: torch.Tensor) -> None:
    """The head starts from the target's rows of the draft vocabulary, the norm and MLP from the target's
    last layer. (EAGLE-1's layer starts random: its output regresses the target's *normed* features, a
    scale the last layer lacks.)"""
    with torch.no_grad():
        module.lm_head.weight.copy_(target.lm_head.weight[vocab])
        module.d2t.copy_(vocab - torch.arange(len(vocab)))
        module.norm.load_state_dict(target.model.norm.state_dict())
    module.midlayer.mlp.load_state_dict(target.model.layers[-1].mlp.state_dict())
