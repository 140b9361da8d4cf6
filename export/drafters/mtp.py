"""DeepSeek-style multi-token prediction (MTP) modules.

Module k (k = 1..N) continues the previous module's hidden states one token further:

    h_k[t] = block( eh_proj( concat( enorm(embed(x[t+k])), hnorm(h_{k-1}[t]) ) ) )
    logits_k[t] = head(shared_head.norm(h_k[t]))   predicts x[t+k+1]

h_0 is the target's last hidden state. Either N cascaded modules (one per draft step) or one module
reused for every step (`num_modules` 1, `num_steps` S). Each step keeps its own KV cache at run
time, since its inputs differ. Names follow the DeepSeek layout inside one module
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's usual layer names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specrt.export.drafters.base import FeatureDrafter, FrozenTargetWeights, one_layer, plain_layer_state
from specrt.export.modeling import DecoderLayer, RMSNorm
from specrt.schema.config import DecoderConfig


@dataclass
class MtpConfig:
    kind: str = "mtp"
    num_modules: int = 1
    num_steps: int = 3  # draft tokens per round; modules are reused when num_steps > num_modules

    def module_for(self, step: int) -> int:
        """The module (0-based) that runs draft step `step` (0-based)."""
        return min(step, self.num_modules - 1)


class SharedHead(nn.Module):
    def __init__(self, dec: DecoderConfig):
        super().__init__()
        self.norm = RMSNorm(dec.hidden_size, dec.rms_norm_eps)


class MtpModule(FeatureDrafter):
    """One MTP module: its own norms, projection and decoder block; the target's embedding and head."""

    def __init__(self, dec: DecoderConfig):
        super().__init__()
        self.dec = one_layer(dec)
        h = dec.hidden_size
        self.enorm = RMSNorm(h, dec.rms_norm_eps)
        self.hnorm = RMSNorm(h, dec.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(self.dec)
        self.shared_head = SharedHead(dec)

    @property
    def layer(self):
        return self.block

    def mix(self, input_ids, hidden):
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], -1))
        return self.block.input_layernorm(x), x

    def head_input(self, out):
        return self.shared_head.norm(out)


class MtpModules(FrozenTargetWeights):
    def __init__(self, cfg: MtpConfig, dec: DecoderConfig):
        super().__init__()
        self.cfg, self.dec = cfg, dec
        self.mtp = nn.ModuleList(MtpModule(dec) for _ in range(cfg.num_modules))

    def attach_target(self, embed, lm_head) -> None:
        first = self.mtp[0]
        first.attach_target(embed, lm_head)
        for m in self.mtp[1:]:  # one copy of the shared weights
            m.embed_tokens, m.lm_head = first.embed_tokens, first.lm_head

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items()
                if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}


def mtp_warm_start(module: MtpModules, target, vocab) -> None:
    """Every MTP block starts as the target's last decoder layer (its output is normed before the head);
    a sandwich-normed (Gemma-2/3) layer gives its attention, MLP and pre-MLP norm."""
    last = plain_layer_state(target.model.layers[-1])
    for m in module.mtp:
        m.block.load_state_dict(last)
        m.shared_head.norm.load_state_dict(target.model.norm.state_dict())
