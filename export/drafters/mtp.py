"""DeepSeek-style multi-token prediction (MTP) modules.

Module k (k = 1..N) continues the previous module's hidden states one token further:

    h_k[t] = block( eh_proj( concat( enorm(embed(x[t+k])), hnorm(h_{k-1}[t]) ) ) )
    logits_k[t] = head(shared_head.norm(h_k[t]))   predicts x[t+k+1]

h_0 is the target's last hidden state. Either N cascaded modules (one per draft step) or one module
reused for every step (`num_modules` 1, `num_steps` S). Each step keeps its own KV cache at run
time, since its inputs differ. Names follow the DeepSeek layout inside one module
(`enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, the block's usual layer names).

The kind's code, all here: the modules, their graph mix (mtp/module_{k}.onnx, one per module:
export/drafters/graphs.py's feature layer), the objective, the warm start, and the public
DeepSeek-V3-style layout: a model folder whose layers L .. L+n-1 (L = num_hidden_layers,
n = num_nextn_predict_layers) are MTP modules; dense Llama-style blocks only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specrt.errors import SpecrtError
from specrt.export.drafter_export import feature_parity, save_graph, vocab_ids_entry
from specrt.export.drafters import make_config
from specrt.export.drafters.base import FeatureDrafter, FrozenTargetWeights, one_layer, plain_layer_state
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
from specrt.export.modeling import DecoderLayer, RMSNorm
from specrt.export.training.objectives import FeatureObjective
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

    def graph_mix(self, fg, ids: str, hidden: str):
        fg.named("mtp")
        e = fg.norm(fg.embed(ids), self.enorm, "enorm")
        h = fg.norm(hidden, self.hnorm, "hnorm")
        x = fg.linear(fg.g.op("Concat", e, h, axis=-1), [self.eh_proj], "eh_proj")
        return fg.norm(x, self.block.input_layernorm, "input_layernorm"), x

    def head_input(self, out):
        return self.shared_head.norm(out)

    def graph_head_norm(self):
        return self.shared_head.norm


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

    def set_head_vocab(self, ids) -> None:
        super().set_head_vocab(ids)
        for m in self.mtp:  # each module's graph has the head
            m.set_head_vocab(ids)


def mtp_warm_start(module: MtpModules, target, vocab) -> None:
    """Every MTP block starts as the target's last decoder layer (its output is normed before the head);
    a sandwich-normed (Gemma-2/3) layer gives its attention, MLP and pre-MLP norm."""
    last = plain_layer_state(target.model.layers[-1])
    for m in module.mtp:
        m.block.load_state_dict(last)
        m.shared_head.norm.load_state_dict(target.model.norm.state_dict())


# ---------------------------------------------------------------------------------------------- export


def mtp_graphs(module, tmp: Path, target_cfg, source: str, check_parity: bool) -> tuple[dict, dict, dict]:
    """mtp/module_{k}.onnx, one per MTP module, and mtp/vocab_ids.npy where their head covers a draft
    vocabulary."""
    graphs, parity = {}, {}
    for k, m in enumerate(module.mtp):
        role = f"mtp.{k}"
        graphs[role] = save_graph(feature_graph(m, role), tmp / "mtp" / f"module_{k}.onnx", role, m.dec, source)
        if check_parity:
            parity[role] = feature_parity(m, tmp / graphs[role].file)
    return graphs, vocab_ids_entry(module.head_vocab, tmp, "mtp"), parity


# ---------------------------------------------------------------------------------------------- training


class MtpObjective(FeatureObjective):
    """Module k (or the one module, reused) on module k-1's output of row r-1, causal over its own rows
    (DeepSeek): CE(p[r+1])."""

    ttt = False

    def __init__(self, module, data, label_vocab, steps=None):
        super().__init__(module, data, label_vocab, steps or module.cfg.num_steps)

    def module_for(self, step):
        return self.m.mtp[self.m.cfg.module_for(step)]


# ---------------------------------------------------------------------------------------------- public layout


PUBLIC = PublicLayout("MTP (num_nextn_predict_layers)", lambda p: (p.meta.get("num_nextn_predict_layers") or 0) > 0)


def load_mtp(folder: Path, meta: dict, weights, target):
    src = weights.path
    check_dims(meta, target, folder / CONFIG)
    n, layers = int(meta["num_nextn_predict_layers"]), int(meta.get("num_hidden_layers", target.cfg.num_layers))
    if layers != target.cfg.num_layers:
        raise SpecrtError(f"{folder / CONFIG}: the MTP modules follow a {layers}-layer model, the target has "
                          f"{target.cfg.num_layers} layers: {FIX}")
    pattern = re.compile(r"model\.layers\.(\d+)\.")
    keys = []
    for k in weights.keys():
        m = pattern.match(k)
        if m and int(m[1]) >= layers and not ignored(k) \
                and not k.endswith((".embed_tokens.weight", ".shared_head.head.weight")):
            keys.append(k)
    moe = [k for k in keys if re.search(r"\.mlp\.(experts|shared_experts|gate)\.", k)]
    if moe:
        raise SpecrtError(f"{src}: the MTP blocks use a mixture-of-experts MLP ({moe[0]}); only dense Llama-style "
                          "MLP blocks (gate_proj / up_proj / down_proj) are supported")
    mla = [k for k in keys if re.search(r"\.self_attn\.(q_a_proj|kv_a_proj)", k)]
    if mla:
        raise SpecrtError(f"{src}: the MTP blocks use multi-head latent attention ({mla[0]}); only Llama-style "
                          "attention (q_proj / k_proj / v_proj / o_proj) is supported")
    cfg = make_config("mtp", num_modules=n, num_steps=max(n, 3))
    module = build_for(cfg, target, layer_dec(target, {}, keys, f"model.layers.{layers}.", src))

    def to_public(k: str) -> str:
        _, idx, rest = k.split(".", 2)
        return f"model.layers.{layers + int(idx)}.{rest.removeprefix('block.')}"

    fill(module, weights, keys, to_public, f"{n}-module MTP (layers {layers}..{layers + n - 1})")
    return module
