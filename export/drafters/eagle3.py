"""EAGLE-3 head: fused low/mid/high target features, a reduced draft vocabulary, a dynamic tree.

The target's low / middle / high layer features are fused first, g = fc(concat(a_low, a_mid,
a_high)); the layer's attention reads concat(norm(embed(x)), norm(g)) (2H wide), its output feeds
the next drafted row directly, and logits come from its own norm + LM head over a reduced draft
vocabulary (`d2t`: target id = draft id + d2t[draft id]).

The kind's code, all here: the module, its graphs

    eagle3/layer.onnx, eagle3/fuse.onnx (aux_hidden_states [B,T,n·H] ─► hidden [B,T,H], the fc),
    eagle3/vocab_ids.npy (draft id -> target id)

(a layout the block drafter shares: `fused_layer_graphs`), its objective (EAGLE's unrolled steps,
step 1 reading fc(low, mid, high), CE over the draft vocabulary only), its warm start and options
from the data, and the public EAGLE-3 layout: `fc` [H, n·H], `midlayer.*`, `norm`, `lm_head`
[draft vocab, H], `d2t` (`t2d` is derived and ignored); taps from
eagle_config.eagle_aux_hidden_state_layer_ids. Parameter names follow that layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specrt.errors import SpecrtError
from specrt.export.decoder_graph import _np
from specrt.export.drafter_export import feature_parity, save_graph, session_parity, vocab_ids_entry
from specrt.export.drafters import make_config
from specrt.export.drafters.base import FeatureDrafter, default_taps, one_layer
from specrt.export.drafters.graphs import feature_graph
from specrt.export.drafters.public import (
    CONFIG,
    FIX,
    PublicLayout,
    build_for,
    check_dims,
    fill,
    ignored,
    layer_dec,
)
from specrt.export.modeling import MLP, Attention, RMSNorm
from specrt.export.training.objectives import FeatureObjective
from specrt.plugins.onnx_builder import FLOAT, GraphBuilder
from specrt.schema.config import DecoderConfig


@dataclass
class Eagle3Config:
    kind: str = "eagle3"
    taps: list[int] = field(default_factory=list)  # target layers whose *inputs* are fused
    draft_vocab_size: int = 0  # 0: the target's vocabulary
    # the head is the target's LM-head rows of the draft vocabulary, frozen, and not stored: a checkpoint
    # keeps d2t and slices the rows from the target when it loads (specrt's own training does this)
    head_from_target: bool = False


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

    def graph_mix(self, fg, ids: str, hidden: str):
        fg.named("midlayer")
        e = fg.norm(fg.embed(ids), self.midlayer.input_layernorm, "input_layernorm")
        h = fg.norm(hidden, self.midlayer.hidden_norm, "hidden_norm")
        return fg.g.op("Concat", e, h, axis=-1), hidden

    def head_input(self, out):
        return self.norm(out)

    def graph_head_norm(self):
        return self.norm

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


# ---------------------------------------------------------------------------------------------- export


def fuse_graph(module: Eagle3Head, name: str = "eagle3_fuse"):
    """aux_hidden_states [B,T,n·H] ─► hidden [B,T,H]: the fc that fuses the tapped target features."""
    g = GraphBuilder(name)
    n = module.fc.in_features
    aux = g.input("aux_hidden_states", FLOAT, ["batch", "tokens", n])
    y = g.op("MatMul", aux, g.weight("fc.weight", _np(module.fc.weight).T), name="fc")
    g.output(y, "hidden", FLOAT, ["batch", "tokens", module.fc.out_features])
    return g.model(doc="specrt EAGLE-3 feature fusion")


def fused_layer_graphs(module, tmp: Path, source: str, check_parity: bool, role: str, target_cfg,
                       mask_rows: int = 0) -> tuple[dict, dict, dict]:
    """ROLE/layer.onnx, ROLE/fuse.onnx (low/mid/high features -> one) and ROLE/vocab_ids.npy: EAGLE-3's
    layout, which the block drafter shares (its parity also run with `mask_rows` mask rows)."""
    folder, fuse = tmp / role, f"{role}_fuse"
    graphs = {role: save_graph(feature_graph(module, role), folder / "layer.onnx", role, module.dec, source),
              fuse: save_graph(fuse_graph(module, fuse), folder / "fuse.onnx", fuse, target_cfg, source)}
    vocab = vocab_ids_entry(module.target_ids().numpy(), tmp, role)
    parity = {}
    if check_parity:
        a = torch.randn(1, 3, module.fc.in_features, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            parity[fuse] = session_parity(tmp / graphs[fuse].file, {"aux_hidden_states": a}, module.fuse(a))
        parity[role] = max(feature_parity(module, tmp / graphs[role].file, mask_rows=m) for m in {0, mask_rows})
    return graphs, {**vocab, "taps": list(module.cfg.taps)}, parity


def eagle3_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """eagle3/layer.onnx, eagle3/fuse.onnx and eagle3/vocab_ids.npy (draft id -> target id)."""
    return fused_layer_graphs(module, tmp, source, check_parity, "eagle3", target_cfg)


# ---------------------------------------------------------------------------------------------- training


class Eagle3Objective(FeatureObjective):
    """Labels live in the draft vocabulary (the label vocabulary *is* the draft vocabulary here)."""

    def real_hidden(self, batch):
        return self.m.fuse(batch.aux)

    def head_weight_for(self, mod):
        return mod.lm_head.weight


# ---------------------------------------------------------------------------------------------- public layout


def _is_eagle3(p) -> bool:
    weights = p.weights()
    return weights is not None and any(k.startswith("midlayer.") for k in weights.keys())


PUBLIC = PublicLayout("EAGLE-3 (fc + midlayer)", _is_eagle3)


def load_eagle3(folder: Path, meta: dict, weights, target):
    src = weights.path
    check_dims(meta, target, folder / CONFIG)
    keys = [k for k in weights.keys() if not ignored(k) and k not in ("embed_tokens.weight", "t2d")]
    head = weights.tensors(["lm_head.weight"])["lm_head.weight"] if "lm_head.weight" in keys else None
    draft_vocab = int(meta.get("draft_vocab_size") or (head.shape[0] if head is not None else target.cfg.vocab_size))
    taps = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    taps = [int(t) for t in taps] if taps else default_taps(target.cfg.num_layers)
    bad = [t for t in taps if not 0 <= t < target.cfg.num_layers]
    if bad:
        raise SpecrtError(f"{folder / CONFIG}: eagle_aux_hidden_state_layer_ids {taps} name layers the target lacks "
                          f"(it has {target.cfg.num_layers}): {FIX}")
    fc = weights.tensors(["fc.weight"])["fc.weight"] if "fc.weight" in keys else None
    if fc is not None and fc.shape[-1] != len(taps) * target.cfg.hidden_size:
        raise SpecrtError(f"{src}: fc.weight has shape {tuple(fc.shape)}, which fuses "
                          f"{fc.shape[-1] / target.cfg.hidden_size:g} target layers, but the taps are {taps}: "
                          "set eagle_config.eagle_aux_hidden_state_layer_ids in config.json, or " + FIX)
    cfg = make_config("eagle3", taps=taps, draft_vocab_size=draft_vocab)
    module = build_for(cfg, target, layer_dec(target, meta, keys, "midlayer.", folder / CONFIG))
    # without d2t the draft vocabulary must be the target's (the identity map)
    defaults = {"d2t": torch.zeros(draft_vocab, dtype=torch.int64)} if draft_vocab == target.cfg.vocab_size else {}
    fill(module, weights, keys, lambda k: k, "EAGLE-3", defaults)
    ids = module.target_ids()
    if int(ids.min()) < 0 or int(ids.max()) >= target.cfg.vocab_size:
        raise SpecrtError(f"{src}: d2t maps draft ids to target ids outside 0..{target.cfg.vocab_size - 1}: {FIX}")
    return module
