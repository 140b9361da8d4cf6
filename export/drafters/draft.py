"""The vanilla draft model as a trainable drafter: the first N layers of the target (plus its final
norm; embedding and LM head shared and frozen), fine-tuned so that it agrees with the full model.

Exported as the bundle's "draft" role (a decoder graph, like the target's), so it has no graph writer
of its own; its objective is here: the truncated LM (its own forward maths), causal: CE(p[t]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specrt.export.drafters.base import FrozenTargetWeights
from specrt.export.modeling import DecoderLM
from specrt.export.training.objectives import Batch, Objective, soft_ce, top1_hits
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


class DraftObjective(Objective):
    """The truncated LM's own forward maths (DecoderLM.hidden_states: embedding scale, per-layer windows
    and RoPE tables, sandwich norms, softcaps), causal from an empty cache: what its graph exports."""

    def logits(self, batch: Batch) -> torch.Tensor:
        """Logits [B,T,|S|] over the label vocabulary of every row of `batch`."""
        lm = self.m.lm
        b, t = batch.tokens.shape
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, -1, -1)
        hidden, _ = lm.hidden_states(batch.tokens, torch.arange(t).expand(b, -1), torch.zeros(b, dtype=torch.long),
                                     causal, lm.new_kv(b, t))
        return lm.logits(hidden, self.sub_weight(lm.lm_head.weight))

    def __call__(self, batch):
        logits = self.logits(batch)
        loss = soft_ce(logits, batch.label_ids, batch.label_p, batch.valid)
        return loss, [top1_hits(logits, batch.label_top, batch.answer)]
