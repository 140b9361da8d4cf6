"""An EAGLE-3 drafter layer run by the native kernels: one C call per draft pass, no graph interpreter.

The layer graph (export/drafters/graphs.py) is read by its initializer names, as weights.py reads the target:
the mix's norms (`midlayer.input_layernorm`, `midlayer.hidden_norm`), the int4 layer (`layer.*_proj`), the
head's norm and its draft-vocabulary head (`lm_head.weight.T`), the embedding table; and the fuse graph's
int4 fc (`fc.weight`). A drafter's arithmetic decides only what is proposed, never what is committed (the
target's verify pass decides every token), so running it on other kernels than ONNX Runtime's changes speed
and, at most, which drafts are accepted.

`feature_layer_unsupported(path)` says why a layer graph cannot run here (another kind's mix, float weights);
the runtime then runs it on ONNX Runtime (runtime/drafters/features.py).
"""

from __future__ import annotations

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

MIX_NORMS = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight")  # EAGLE-3's mix


def _graph(path: Path) -> tuple[onnx.ModelProto, dict, dict]:
    model = onnx.load(str(path), load_external_data=False)  # data mapped by tensor_array (engines/tables.py)
    inits = {t.name: t for t in model.graph.initializer}
    by_weight = {n.input[1]: n for n in model.graph.node if n.op_type == "MatMulNBits"}
    return model, inits, by_weight


def feature_layer_unsupported(path: Path, cfg: DecoderConfig) -> str:
    """Why the drafter layer graph at `path` cannot run natively, as a phrase; "" when it can."""
    why = unsupported(cfg)
    if why:
        return f"its layer computes {why}"
    model = onnx.load(str(path), load_external_data=False)
    names = {t.name for t in model.graph.initializer}
    if not all(n in names for n in MIX_NORMS):
        return "its mix is not EAGLE-3's (norm(embed) ‖ norm(feature))"
    if float_projections(model):
        return "it has float projections (export it with --quantize int4)"
    return ""


class NativeFeatureLayer(NativeDecoder):
    """The Decoder protocol over one EAGLE-3 layer (batch 1): `run_all(..., hidden_in=)` gives logits over the
    draft vocabulary and the layer outputs; `fuse(aux)` is the fuse graph's fc on the same kernels."""

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
        _, inits, by_weight = _graph(path)
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
                              int(threads), 1)
        if not h:
            raise SpecrtError(f"native backend: {library.last_error()}")
        self._h = h
        ok = calls.use_embed(lib, h, self.embed)
        self._norms = [arr(MIX_NORMS[0]), arr("layer.post_attention_layernorm.weight"), arr("head.head_norm.weight"),
                       arr(MIX_NORMS[1])]  # spn_set_norm's `which` order
        for which, w in enumerate(self._norms):
            ok &= calls.set_norm(lib, h, 0, which, w)
        for which, name in enumerate(PROJECTIONS):
            ok &= calls.set_linear(lib, h, 0, which, int4_projection(path, inits, by_weight, f"layer.{name}.weight"))
        ok &= calls.set_linear(lib, h, -1, 0, head)
        self.rope_rows = capacity + 64
        ok &= calls.set_rope(lib, h, *rope_tables(cfg, self.rope_rows))
        if not ok:
            raise SpecrtError(f"native backend: loading {path} failed: {library.last_error()}")
        self._fuse = None
        if fuse_path is not None:  # in the layer (a catch-up pass fuses its rows: run_all's aux_in) and alone
            _, finits, fweights = _graph(fuse_path)
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
        y = np.empty((x.shape[0], n), np.float32)
        if calls.linear_run(self.lib, self._fuse, library.KERNELS[self.kernel], int(self.threads), x, y) != 0:
            raise SpecrtError(f"native fuse failed: {library.last_error()}")
        return y

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
