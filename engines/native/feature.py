"""A drafter layer (EAGLE-1/2, EAGLE-3, one MTP module) run by the native kernels: one C call per draft pass,
no graph interpreter.

The layer graph (export/drafters/graphs.py) is read by its initializer names, as weights.py reads the target:
the mix's norms and projection (`MIXES`: how the kind mixes a row's token and feature), the int4 layer
(`layer.*_proj`), the head's norm where it has one and its draft-vocabulary head (`lm_head.weight.T`), the
embedding table; and EAGLE-3's fuse graph's int4 fc (`fc.weight`). A drafter's arithmetic decides only what is
proposed, never what is committed (the target's verify pass decides every token), so running it on other
kernels than ONNX Runtime's changes speed and, at most, which drafts are accepted.

`feature_layer_unsupported(path)` says why a layer graph cannot run here (a mix not in `MIXES`, such as the
block drafter's mask rows; float weights); the runtime then runs it on ONNX Runtime
(runtime/drafters/features.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from specrt.engines.native import calls, library
from specrt.engines.native.runner import NativeDecoder, check_threads
from specrt.engines.native.weights import (
    PROJECTIONS,
    float_projections,
    int4_projection,
    rope_tables,
    unsupported,
)
from specrt.engines.tables import EmbeddingTable, tensor_array
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig

# spn_set_norm's `which` for each norm a layer may have
INPUT_NORM, POST_ATTENTION_NORM, HEAD_NORM, FEATURE_NORM, EMBED_NORM = range(5)


@dataclass(frozen=True)
class Mix:
    """How one kind's layer graph mixes a row's token and feature (csrc/model.cpp `Mix`), by the names its
    writer gives the weights (the kind's `graph_mix` in export/drafters/<kind>.py)."""

    kind: str  # the drafter kind whose graphs have it
    code: int  # spn_model_new's `feature`: 1 EAGLE-3's concat, 2 a projected mix
    norms: dict[int, str]  # spn_set_norm `which` -> initializer name
    required: tuple[int, ...]  # the norms a graph of the kind always has
    projection: str = ""  # a projected mix's P over [embedding; feature] (its bias, where it has one, beside it)
    refused: tuple[str, ...] = field(default=())  # initializers of a look-alike mix the kernels do not compute

    def matches(self, names: set[str], by_weight: dict) -> bool:
        """The graph has this mix's projection (int4, its MatMulNBits; or float, refused as such by
        feature_layer_unsupported) where it has one, and every norm it always has."""
        projected = not self.projection or self.projection + ".weight" in names or any(
            w.startswith(self.projection + ".weight_") for w in by_weight)
        return projected and all(self.norms[w] in names for w in self.required)


MIXES = (
    # concat(norm(embed), norm(feature)), q|k|v 2H wide; the block drafter's mask rows (Where) look alike
    Mix("eagle3", 1, {INPUT_NORM: "midlayer.input_layernorm.weight", FEATURE_NORM: "midlayer.hidden_norm.weight"},
        (INPUT_NORM, FEATURE_NORM), refused=("mask_embed", "mask_hidden")),
    # fc(concat(embed, feature)) + bias, then the layer's input norm where the checkpoint keeps it (EAGLE-1 does not)
    Mix("eagle", 2, {INPUT_NORM: "eagle.input_layernorm.weight"}, (), projection="eagle.fc"),
    # eh_proj(concat(enorm(embed), hnorm(feature))), then the layer's input norm
    Mix("mtp", 2, {EMBED_NORM: "mtp.enorm.weight", FEATURE_NORM: "mtp.hnorm.weight",
                   INPUT_NORM: "mtp.input_layernorm.weight"}, (EMBED_NORM, FEATURE_NORM, INPUT_NORM),
        projection="mtp.eh_proj"),
)


def graph_mix(names: set[str], by_weight: dict) -> Mix | None:
    """The mix of a layer graph with initializers `names` and MatMulNBits nodes `by_weight`; None: not one of MIXES."""
    for mix in MIXES:
        if mix.matches(names, by_weight) and not any(n in names for n in mix.refused):
            return mix
    return None


def read_graph(path: Path) -> tuple[onnx.ModelProto, dict, dict]:
    """A drafter graph's model, its initializers by name and its MatMulNBits nodes by weight name."""
    model = onnx.load(str(path), load_external_data=False)  # data mapped by tensor_array (engines/tables.py)
    inits = {t.name: t for t in model.graph.initializer}
    by_weight = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    return model, inits, by_weight


def feature_layer_unsupported(path: Path, cfg: DecoderConfig) -> str:
    """Why the drafter layer graph at `path` cannot run natively, as a phrase; "" when it can."""
    why = unsupported(cfg)
    if why:
        return f"its layer computes {why}"
    model, inits, by_weight = read_graph(path)
    if graph_mix(set(inits), by_weight) is None:
        return ("its mix is none the kernels compute (EAGLE-3's norm(embed) ‖ norm(feature), EAGLE's or MTP's "
                "projection of embed ‖ feature)")
    if float_projections(model):
        return "it has float projections (export it with --quantize int4)"
    return ""


class NativeFeatureLayer(NativeDecoder):
    """The Decoder protocol over one drafter layer (batch 1): `run_all(..., hidden_in=)` gives logits over the
    draft vocabulary and the layer outputs; `fuse(aux)` is EAGLE-3's fuse graph's fc on the same kernels."""

    def __init__(self, path: Path, fuse_path: Path | None, cfg: DecoderConfig, capacity: int, threads: int = 2,
                 kernel: str = "auto", embedding: EmbeddingTable | None = None):
        """`embedding`: the target's table [V, H] (read in place), for a layer graph that stores none (it reads
        `inputs_embeds`); a layer of an older bundle brings its own copy."""
        why = feature_layer_unsupported(path, cfg)
        if why:
            raise SpecrtError(f"{path}: the native backend cannot run this drafter layer: {why}")
        check_threads(threads)
        self.lib = lib = library.load()
        self.kernel, self.kernel_record = library.kernel(kernel)
        self.path, self.cfg, self.capacity, self.batch, self.threads = Path(path), cfg, capacity, 1, threads
        self.taps = []
        _, inits, by_weight = read_graph(path)
        self.mix = graph_mix(set(inits), by_weight)
        arr = lambda name: np.ascontiguousarray(tensor_array(path, inits[name]), np.float32)  # noqa: E731
        if "embed_tokens.weight" in inits:
            embedding = EmbeddingTable(dense=arr("embed_tokens.weight"))
        if embedding is None:
            raise SpecrtError(f"{path} reads inputs_embeds: the native layer needs the target's embedding table")
        self.embed = embedding  # read in place (spn_use_embed): keep it alive
        head = int4_projection(path, inits, by_weight, "lm_head.weight.T")
        self.vocab = head.n
        h = lib.spn_model_new(1, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                              self.embed.shape[0], float(cfg.rms_norm_eps), 1.0, library.KERNELS[self.kernel],
                              int(threads), self.mix.code)
        if not h:
            raise SpecrtError(f"native backend: {library.last_error()}")
        self._h = h
        ok = calls.use_embed(lib, h, self.embed)
        norms = {**self.mix.norms, POST_ATTENTION_NORM: "layer.post_attention_layernorm.weight",
                 HEAD_NORM: "head.head_norm.weight"}
        for which, name in norms.items():  # a norm the graph has not is the kernels' none (the mix allows it)
            if name in inits:
                ok &= calls.set_norm(lib, h, 0, which, arr(name))
        for which, name in enumerate(PROJECTIONS):
            ok &= calls.set_linear(lib, h, 0, which, int4_projection(path, inits, by_weight, f"layer.{name}.weight"))
        ok &= calls.set_linear(lib, h, -1, 0, head)
        if self.mix.projection:
            proj = int4_projection(path, inits, by_weight, self.mix.projection + ".weight")
            if self.mix.projection + ".bias" in inits:
                proj.bias = arr(self.mix.projection + ".bias")
            ok &= calls.set_linear(lib, h, -1, 2, proj)
        self.rope_rows = capacity + 64
        ok &= calls.set_rope(lib, h, *rope_tables(cfg, self.rope_rows))
        if not ok:
            raise SpecrtError(f"native backend: loading {path} failed: {library.last_error()}")
        self._fuse = None
        if fuse_path is not None:  # in the layer (a catch-up pass fuses its rows: run_all's aux_in) and alone
            _, finits, fweights = read_graph(fuse_path)
            fc = int4_projection(fuse_path, finits, fweights, "fc.weight")
            self._fuse = calls.linear_new(lib, fc)
            if not self._fuse or not calls.set_linear(lib, h, -1, 1, fc):
                raise SpecrtError(f"native backend: loading {fuse_path} failed: {library.last_error()}")
            self._fuse_shape = (fc.k, fc.n)
        shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.kv = [np.zeros(shape, np.float32) for _ in range(2)]
        self._slot_stride = cfg.num_kv_heads * capacity * cfg.head_dim
        self._kv_ptrs = {}
        self.slots = (0, 1)
        self._outputs = {}
        # a catch-up's inputs (`causal`), made once: token ids, every position, past and the logits row, and
        # the causal mask of each window length asked for
        self._ids = np.zeros(capacity, np.int64)
        self._positions = np.arange(capacity, dtype=np.int64)
        self._past, self._last = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self._addr = {name: getattr(self, name).ctypes.data for name in ("_ids", "_positions", "_past", "_last")}
        self._masks: dict[int, tuple[np.ndarray, int]] = {}

    def __del__(self):
        fuse = getattr(self, "_fuse", None)
        if fuse:
            self.lib.spn_linear_free(fuse)
            self._fuse = None
        super().__del__()

    def output_shape(self, name: str) -> tuple | None:
        shapes = {"logits": ("batch", "rows", self.vocab), "hidden_states": ("batch", "tokens", self.cfg.hidden_size)}
        return shapes.get(name)

    def fuse(self, aux: np.ndarray) -> np.ndarray:
        """The fuse graph's fc: aux [T, n·H] -> the layer's feature input [T, H]."""
        k, n = self._fuse_shape
        x = np.ascontiguousarray(aux, np.float32).reshape(-1, k)
        return calls.product(self.lib, self._fuse, library.KERNELS[self.kernel], int(self.threads), x, n, "fuse")

    def causal(self, ids: list[int], aux: np.ndarray, start: int) -> dict[str, np.ndarray]:
        """`run_all` over one causal window of committed rows start..start+T-1 (tokens `ids`, the target's tapped
        rows `aux` [T, n·H], fused in the pass), logits for its last row only: a catch-up, the one pass of each
        step of a chain of one draft. Its inputs are written into buffers made once (a step's Python around the
        native call ran ~2x the call itself on AVX2); every size run_all checks is checked here too."""
        t = len(ids)
        if self._fuse is None or aux.shape != (t, self._fuse_shape[0]) or aux.dtype != np.float32 or \
                not aux.flags.c_contiguous or t < 1 or start < 0:
            raise SpecrtError(f"internal: a causal catch-up of {t} rows from {start} with tapped rows {aux.shape}")
        if start + t > self.capacity:
            raise SpecrtError(f"KV capacity {self.capacity} exceeded ({start + t} rows): raise --max-seq-len")
        mask = self._masks.get(t)
        if mask is None:
            tril = np.tril(np.ones((t, t), np.bool_))
            mask = self._masks[t] = (tril, tril.ctypes.data)
        self._ids[:t] = ids
        self._past[0], self._last[0] = start, t - 1
        out = {"logits": self._buffer("logits", (1, 1, self.vocab)),
               "hidden_states": self._buffer("hidden_states", (1, t, self.cfg.hidden_size))}
        addr = self._addr
        rc = self.lib.spn_feature_pass(self._h, t, addr["_ids"], None, aux.ctypes.data, aux.size,
                                       addr["_positions"] + 8 * start, addr["_past"], mask[1], 1, addr["_last"],
                                       self._kv_pointers(0), self.capacity, out["logits"].ctypes.data,
                                       out["hidden_states"].ctypes.data)
        if rc != 0:
            raise SpecrtError(f"native feature pass failed: {library.last_error()}")
        return out

    def run_all(self, input_ids, position_ids, past_len, tree_mask, logits_index, hidden_in=None, aux_in=None,
                **extra) -> dict[str, np.ndarray]:
        """`hidden_in` [1, T, H]: the rows' features; or `aux_in` [1, T, n·H]: the target's tapped rows, fused into
        them by the fuse graph's fc in the same call (one native call for a catch-up)."""
        if extra or (hidden_in is None) == (aux_in is None):
            raise SpecrtError("internal: a native feature layer takes hidden_in or aux_in, and nothing else")
        if aux_in is not None and self._fuse is None:
            raise SpecrtError("internal: this native feature layer has no fuse graph for aux_in")
        ids = np.ascontiguousarray(input_ids, np.int64).reshape(-1)
        ids = np.maximum(ids, 0)  # a padded row's -1 reads row 0, as the ONNX Runtime layer's inputs_embeds do
        t = len(ids)
        if np.asarray(input_ids).shape[0] != 1:
            raise SpecrtError("internal: a native feature layer runs one sequence")
        pos = np.ascontiguousarray(position_ids, np.int64).reshape(t)
        past = np.ascontiguousarray(past_len, np.int64).reshape(1)
        mask = np.ascontiguousarray(tree_mask, np.bool_).reshape(t, t)
        index = np.ascontiguousarray(logits_index, np.int64).reshape(-1)
        width = self.cfg.hidden_size if aux_in is None else self._fuse_shape[0]
        feats = np.ascontiguousarray(hidden_in if aux_in is None else aux_in, np.float32).reshape(t, width)
        self.check_rows(past, t)
        if int(pos.max(initial=0)) >= self.rope_rows:
            raise SpecrtError(f"position {int(pos.max())} is past this layer's rotary table ({self.rope_rows} rows)")
        out = {"logits": self._buffer("logits", (1, len(index), self.vocab)),
               "hidden_states": self._buffer("hidden_states", (1, t, self.cfg.hidden_size))}
        given, fused = (feats, None) if aux_in is None else (None, feats)
        rc = self.lib.spn_feature_pass(self._h, t, calls.ptr(ids), calls.ptr(given), calls.ptr(fused),
                                       0 if fused is None else fused.size, calls.ptr(pos), calls.ptr(past), calls.ptr(mask),
                                       len(index), calls.ptr(index), self._kv_pointers(0), self.capacity,
                                       calls.ptr(out["logits"]), calls.ptr(out["hidden_states"]))
        if rc != 0:
            raise SpecrtError(f"native feature pass failed: {library.last_error()}")
        return out
