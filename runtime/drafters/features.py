"""Run-time pieces shared by the learned drafters: the target state they read, and a feature layer
(EAGLE, EAGLE-3 or MTP graph) with its own KV cache that drafts over trees.

`TargetState` holds, per committed token, the target's last hidden state (and the tapped layers'
inputs when the target graph outputs them). The generator fills it after prefill and after every
verify (accepted rows only), so it always covers every committed token but the last one (whose
hidden state comes with the next verify pass).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specrt.engines.ort_cpu.runner import OrtDecoder
from specrt.engines.tables import EmbeddingTable
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig

NATIVE_TARGETS = ("native",)  # target backends whose drafters' layers run natively too, where they can
# each kind of drafter graph the native kernels run, and what says why they cannot run one ((path, cfg) -> a
# phrase, "" when they can)
NATIVE_GRAPHS = {
    "layer": "specrt.engines.native.feature:feature_layer_unsupported",  # EAGLE-1/2, EAGLE-3, MTP (MIXES)
    "decoder": "specrt.engines.native.weights:decoder_unsupported",  # the draft model
    "medusa": "specrt.engines.native.medusa:medusa_unsupported",  # Medusa's heads
}


def layer_backend(path, cfg: DecoderConfig, target_backend: str, requested: str = "auto",
                  graph: str = "layer") -> tuple[str, dict]:
    """Where a drafter graph of kind `graph` (NATIVE_GRAPHS) runs, and the branch record (specrt/branches.py
    `drafter_layers`): under auto, on the native kernels when the target does and the graph is one they compute
    (int4, of a form they run), else on ONNX Runtime. Either way the target's verify decides every token: only
    the speed differs."""
    from specrt.branches import pick, record

    choice = pick("drafter_layers", requested)
    why = ""
    if choice.value != "ort":
        from specrt.engines.native import library
        from specrt.kinds import resolve

        if choice.value == "auto" and target_backend not in NATIVE_TARGETS:
            return "ort", record(choice, "ort", f"the target runs on {target_backend}")
        unsupported = resolve(NATIVE_GRAPHS[graph])
        why = "no C++ compiler for the native kernels" if library.compiler() is None else unsupported(path, cfg)
    if choice.value == "native" and why:
        raise SpecrtError(f"drafter layers forced native ({choice.forced_by}) but {path} cannot run there: {why}; "
                          "unset it or choose ort")
    if choice.value == "auto":
        name = "ort" if why else "native"
        return name, record(choice, name, why or "the target runs on native")
    return choice.value, record(choice, choice.value)


@dataclass
class TargetState:
    hidden: np.ndarray  # [capacity, H]
    aux: np.ndarray | None  # [capacity, n·H] when the target graph has aux_hidden_states

    @classmethod
    def allocate(cls, capacity: int, hidden_size: int, aux_size: int | None) -> TargetState:
        return cls(np.zeros((capacity, hidden_size), np.float32),
                   None if aux_size is None else np.zeros((capacity, aux_size), np.float32))

    def write(self, rows, outs: dict, window_rows) -> None:
        """Copy the pass outputs of window rows `window_rows` into state rows `rows`."""
        self.hidden[rows] = outs["hidden_states"][0, window_rows]
        if self.aux is not None:
            self.aux[rows] = outs["aux_hidden_states"][0, window_rows]


def takes_embeds(path) -> bool:
    """Whether the layer graph at `path` reads the target's embedding rows as `inputs_embeds` (bundles
    exported before that store a copy of the table in the layer)."""
    import onnx

    return any(i.name == "inputs_embeds" for i in onnx.load(str(path), load_external_data=False).graph.input)


def _ort_fuse(path, threads: int):
    """The fuse graph as an ONNX Runtime session: aux [T, n·H] -> features [T, H]."""
    import onnxruntime as ort

    from specrt.engines.ort_cpu.runner import session_options

    session = ort.InferenceSession(str(path), session_options(threads, spin=False), providers=["CPUExecutionProvider"])
    return lambda aux: session.run(None, {"aux_hidden_states": aux[None]})[0][0]


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share. Every step asks it of a sequence and the same sequence one
    step on, where one is a prefix of the other: that is one comparison of the lists, in C, not a Python loop
    over the whole context; where they differ, halving finds the first difference."""
    limit = min(len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    same, differ = 0, limit  # a[:same] == b[:same], a[:differ] != b[:differ]
    while differ - same > 1:
        mid = (same + differ) // 2
        if a[same:mid] == b[same:mid]:
            same = mid
        else:
            differ = mid
    return same


class FeatureLayer:
    """One drafter layer graph with a KV cache; row r reads token x[r+1] and a feature vector.

    Rows 0..cached-1 hold committed inputs (the target's features); rows from `cached` on are
    scratch space for drafted rows, rewritten every step.
    """

    def __init__(self, path, cfg: DecoderConfig, capacity: int, threads: int, target_backend: str = "ort",
                 fuse_path=None, embedding: Callable[[], EmbeddingTable] | None = None):
        """`fuse_path`: EAGLE-3's fuse graph, run on the same kernels as the layer (`fuse`); `embedding`: the
        target's table (DrafterContext.target_embedding), for a layer graph that reads `inputs_embeds`."""
        self.backend, self.record = layer_backend(path, cfg, target_backend)
        table = embedding() if embedding is not None and takes_embeds(path) else None
        self.embeds = None  # the table this layer gathers `inputs_embeds` from (ONNX Runtime)
        if self.backend == "native":
            from specrt.engines.native.feature import NativeFeatureLayer

            self.model = NativeFeatureLayer(path, fuse_path, cfg, capacity, threads, embedding=table)
            self._fuse = self.model.fuse
        else:
            self.model = OrtDecoder(path, cfg, capacity, threads, spin=False)
            self._fuse = None if fuse_path is None else _ort_fuse(fuse_path, threads)
            self.embeds = table
            if table is None and takes_embeds(path):
                raise SpecrtError(f"internal: {path} reads inputs_embeds and no embedding table was given")
        self.calls = 0  # engine calls (layer passes and fuses), for --json's stats
        self.cached = 0
        self.tokens: list[int] = []  # the committed tokens the cached rows were built from

    def fuse(self, aux: np.ndarray) -> np.ndarray:
        """EAGLE-3's fuse graph: the tapped target features aux [T, n·H] -> the layer's features [T, H]."""
        self.calls += 1
        return self._fuse(aux)

    @property
    def fuses_in_pass(self) -> bool:
        """Can a pass take the target's tapped rows and fuse them itself (one native call, not two)?"""
        return self.backend == "native" and self._fuse is not None

    def sync(self, tokens: list[int]) -> None:
        """Drop cached rows whose token (x[r+1]) is no longer the committed one."""
        keep = max(0, common_prefix(self.tokens, tokens) - 1)
        self.cached = min(self.cached, keep)
        self.tokens = list(tokens)

    def run(self, ids, hidden: np.ndarray, positions, past: int, mask: np.ndarray, rows) -> tuple[np.ndarray, np.ndarray]:
        """(logits [R, V'] for window `rows`, features [T, H]) of a pass over rows with features `hidden`."""
        ids = np.asarray([ids], np.int64)
        extra = {} if self.embeds is None else {"inputs_embeds": self.embeds[np.maximum(ids, 0)]}
        extra["hidden_in"] = np.asarray(hidden, np.float32)[None]
        logits, out = self.model.run(ids, np.asarray(positions, np.int64)[None], np.array([past], np.int64),
                                     mask[None], np.asarray([rows], np.int64), **extra)
        self.calls += 1
        return logits[0], out[0]

    def catch_up(self, tokens: list[int], features, upto: int, mask_rows: int = 0,
                 taps=None) -> tuple[np.ndarray, np.ndarray]:
        """Feed committed rows cached..upto-1 (row r: token x[r+1], feature `features(start, end)`, or with
        `taps(start, end)` the target's tapped rows, fused: in the same call where the layer `fuses_in_pass`),
        then `mask_rows` mask rows (id -1: the block drafter's), causal over the window; returns (logits of
        row upto-1, which drafts x[upto+1], and of each mask row; features of the fed rows). Mask rows
        are scratch: the cache keeps only the committed rows."""
        start = min(self.cached, upto - 1)  # row upto-1 is always fed: its logits are the root's
        if start < 0:
            raise SpecrtError("internal: drafter catch-up needs at least one committed row")
        t = upto - start
        if taps is not None and self.fuses_in_pass and not mask_rows:  # one native call, its inputs made once
            out = self.model.causal(tokens[start + 1 : upto + 1], taps(start, upto), start)
            self.calls += 1
            self.cached = upto
            return out["logits"][0, 0], out["hidden_states"][0]
        feats = self.fuse(taps(start, upto)) if taps is not None else features(start, upto)
        ids = tokens[start + 1 : upto + 1] + [-1] * mask_rows
        if mask_rows:
            feats = np.concatenate([feats, np.zeros((mask_rows, feats.shape[1]), feats.dtype)])
        logits, out = self.run(ids, feats, np.arange(start, upto + mask_rows), start,
                               np.tril(np.ones((t + mask_rows, t + mask_rows), bool)), list(range(t - 1, t + mask_rows)))
        self.cached = upto
        return (logits if mask_rows else logits[0]), out[:t]
