"""The vanilla draft model as a trainable drafter: the first N layers of the target (plus its final
norm; embedding and LM head shared and frozen), fine-tuned so that it agrees with the full model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from specrt.export.drafters.base import FrozenTargetWeights
from specrt.export.modeling import DecoderLM
from specrt.schema.config import DecoderConfig


@dataclass
class DraftConfig:
    kind: str = "draft"
    num_layers: int = 4


class TruncatedDraft(FrozenTargetWeights):
    def __init__(self, cfg: DraftConfig, dec: DecoderConfig):
        super().__init__()
        self.cfg, self.dec = cfg, dec.truncated(cfg.num_layers)
        self.lm = DecoderLM(self.dec)

    def attach_target(self, embed, lm_head) -> None:
        self.lm.model.embed_tokens.weight = nn.Parameter(embed.detach().float().clone(), requires_grad=False)
        if self.dec.tie_word_embeddings:
            self.lm.lm_head.weight = self.lm.model.embed_tokens.weight
        else:
            self.lm.lm_head.weight = nn.Parameter(lm_head.detach().float().clone(), requires_grad=False)

    def init_from(self, target: DecoderLM) -> None:
        own = self.lm.state_dict()
        self.lm.load_state_dict({k: v for k, v in target.state_dict().items() if k in own}, strict=True)
        self.lm.model.embed_tokens.weight.requires_grad_(False)
        self.lm.lm_head.weight.requires_grad_(False)

    def trainable_state(self):
        return {k: v for k, v in self.state_dict().items()
                if not k.endswith(("embed_tokens.weight", "lm_head.weight"))}
