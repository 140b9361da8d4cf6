"""EAGLE-1/2 head: one decoder layer that drafts over features autoregressively.

Row r fuses the next token's embedding with a feature vector,

    fc(concat(embed(x[r+1]), f[r])) ─► decoder layer ─► f'[r] ─► the target's LM head ─► x[r+2]

where f is the target's last hidden state for committed rows and the head's own output for
drafted rows (trained to regress the target's next hidden state). EAGLE-2 differs only at run
time (a dynamic tree), so both share these weights. EAGLE-3 is export/drafters/eagle3.py.

The kind's code, all here: the module, its graph mix (eagle/layer.onnx: export/drafters/graphs.py's
feature layer), its objective (S unrolled steps, "training-time test": step 1 reads h[r], step s
its own output of row r-1 from step s-1, attending to real rows ≤ r-s+1 plus its own chain, as
drafted rows do at run time: CE(p[r+1]) + SmoothL1(f[r], h[r+1])), and the public SafeAILab
EAGLE-1/2 layout: Llama-style config.json; `fc.*` and `layers.0.*` (EAGLE-1 drops the layer's
input_layernorm). Parameter names follow that layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specrt.export.drafter_export import feature_parity, save_graph, vocab_ids_entry
from specrt.export.drafters import make_config
from specrt.export.drafters.base import FeatureDrafter, one_layer
from specrt.export.drafters.graphs import feature_graph
from specrt.export.drafters.public import (
    CONFIG,
    PublicLayout,
    build_for,
    check_dims,
    fill,
    ignored,
    layer_dec,
)
from specrt.export.modeling import DecoderLayer
from specrt.export.training.objectives import FeatureObjective
from specrt.schema.config import DecoderConfig


@dataclass
class EagleConfig:
    kind: str = "eagle"
    fc_bias: bool = True
    input_norm: bool = False  # EAGLE-1 checkpoints drop input_layernorm in their only layer


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

    def graph_mix(self, fg, ids: str, hidden: str):
        fg.named("eagle")
        x = fg.linear(fg.g.op("Concat", fg.embed(ids), hidden, axis=-1), [self.fc], "fc")
        if isinstance(self.layer.input_layernorm, nn.Identity):
            return x, x
        return fg.norm(x, self.layer.input_layernorm, "input_layernorm"), x


def eagle_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """eagle/layer.onnx: the one decoder layer over (token, feature), and eagle/vocab_ids.npy where its head
    covers a draft vocabulary."""
    graphs = {"eagle": save_graph(feature_graph(module, "eagle"), tmp / "eagle" / "layer.onnx", "eagle", module.dec,
                                  source)}
    parity = {"eagle": feature_parity(module, tmp / graphs["eagle"].file)} if check_parity else {}
    return graphs, vocab_ids_entry(module.head_vocab, tmp, "eagle"), parity


class EagleObjective(FeatureObjective):
    regress = 1.0


def _is_eagle(p) -> bool:
    weights = p.weights()
    if weights is None:
        return False
    keys = weights.keys()
    return "fc.weight" in keys and any(k.startswith("layers.0.") for k in keys) \
        and not any(k.startswith("midlayer.") for k in keys)  # EAGLE-3's


PUBLIC = PublicLayout("EAGLE (fc + layers.0)", _is_eagle)


def load_eagle(folder: Path, meta: dict, weights, target):
    check_dims(meta, target, folder / CONFIG)
    keys = [k for k in weights.keys() if not ignored(k) and k != "embed_tokens.weight"]
    fc_bias = "fc.bias" in keys or meta.get("bias") is True
    cfg = make_config("eagle", fc_bias=fc_bias, input_norm="layers.0.input_layernorm.weight" in keys)
    module = build_for(cfg, target, layer_dec(target, meta, keys, "layers.0.", folder / CONFIG))
    fill(module, weights, keys, lambda k: k, "one-layer EAGLE")
    return module
