"""The TensorRT build plan as plain data: no tensorrt import, so all of it is tested on any machine.

- `profile_shapes`: one optimization profile per graph, (min, opt, max) per input, batch 1. The window
  T and the logits rows R run from 1 to `max_window` (the largest drafted tree + its root); the KV
  length is the static `capacity` (min = opt = max: the cache buffers are allocated once and
  TensorRT's KVCacheUpdate wants a static sequence dimension on the cache input).
- `version_ok`: the oldest TensorRT whose ONNX parser has `OnnxParserFlag.ENABLE_PLUGIN_OVERRIDE`
  and imports `TensorScatter` (both arrived in 10.15, per onnx-tensorrt's changelog).
- `manifest_entry` / `engine_file`: what `specrt build --backend trt` records and writes.
- `plan_chunks`: a window longer than the profile (a long prompt's prefill) run as several passes.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath

import numpy as np

from specrt.errors import SpecrtError
from specrt.plugins.plugin_names import PLUGIN_NAMESPACE, PLUGIN_OPS, PLUGIN_VERSION

MIN_VERSION = (10, 15)
PARSER_FLAG = "ENABLE_PLUGIN_OVERRIDE"  # trt.OnnxParserFlag member
PRECISIONS = ("fp16", "bf16", "fp32")
TIMING_CACHE = "tensorrt.timing-cache"  # in the bundle root, shared by every graph and every build

WINDOW_DIMS = ("tokens", "rows")  # symbolic dims of the exported graphs that follow the window


def parse_version(version: str) -> tuple[int, ...]:
    """'10.15.1.29' → (10, 15, 1, 29); stops at the first part that is not a plain number."""
    parts = []
    for p in str(version).strip().split("."):
        m = re.fullmatch(r"(\d+)", p)
        if not m:
            break
        parts.append(int(m.group(1)))
    return tuple(parts)


def version_ok(version: str) -> bool:
    """True for TensorRT ≥ 10.15 (the parser flag and TensorScatter import); False if unreadable."""
    v = parse_version(version)
    return len(v) >= 2 and v[:2] >= MIN_VERSION


def version_message(version: str) -> str:
    need = ".".join(map(str, MIN_VERSION))
    return (f"TensorRT {version} is too old: specrt's engines need TensorRT >= {need} (ONNX parser flag "
            f"{PARSER_FLAG} and TensorScatter import): `pip install -U 'tensorrt>={need}'`")


def default_capacity(cfg) -> int:
    """The KV capacity the runtime uses when no --max-seq-len is given (see runtime.generate)."""
    return int(min(2048, cfg.max_position_embeddings))


def graph_inputs(path) -> list[tuple[str, list]]:
    """(name, dims) of an ONNX graph's inputs; a dim is an int or its symbolic name. Weights stay on disk."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return [(i.name, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]) for i in model.graph.input]


def profile_shapes(inputs, cfg, capacity: int, max_window: int, opt_window: int | None = None
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Per input name: (min, opt, max) shapes for one optimization profile, batch 1.

    `inputs` as from `graph_inputs`. Symbolic dims: batch → 1; tokens / rows → 1 .. max_window
    (opt: `opt_window`, default max_window, the verify pass); capacity → capacity. Any other
    symbolic dim is refused, so a new graph input cannot silently get a wrong profile.
    """
    capacity, max_window = int(capacity), int(max_window)
    opt = int(opt_window or max_window)
    if not 1 <= opt <= max_window <= capacity:
        raise SpecrtError(f"TensorRT profile needs 1 <= opt window ({opt}) <= max window ({max_window}) "
                          f"<= KV capacity ({capacity})")
    ranges = {"batch": (1, 1, 1), "capacity": (capacity,) * 3, **{d: (1, opt, max_window) for d in WINDOW_DIMS}}
    shapes = {}
    for name, dims in inputs:
        lo, mid, hi = [], [], []
        for d in dims:
            if isinstance(d, int) and d > 0:
                r = (d, d, d)
            elif d in ranges:
                r = ranges[d]
            else:
                raise SpecrtError(f"graph input {name} has dimension {d!r}, which specrt's TensorRT profiles do not "
                                  f"know (known: {', '.join(ranges)}): export the bundle again with this specrt")
            lo.append(r[0])
            mid.append(r[1])
            hi.append(r[2])
        if name.startswith(("past_key.", "past_value.")):
            want = [1, cfg.num_kv_heads, capacity, cfg.head_dim]
            if hi != want or lo != want:
                raise SpecrtError(f"graph input {name} has shape {dims}, expected [batch, {cfg.num_kv_heads}, "
                                  f"capacity, {cfg.head_dim}] from the manifest config: export the bundle again")
        shapes[name] = (tuple(lo), tuple(mid), tuple(hi))
    return shapes


def pinned_shape(lo, hi) -> tuple[int, ...]:
    """The network input shape to declare: dims equal in min and max become static, the others -1."""
    return tuple(a if a == b else -1 for a, b in zip(lo, hi, strict=True))


def dynamic_inputs(shapes: dict) -> dict:
    """The inputs that still have a dynamic dim once pinned: only these go into the profile."""
    return {n: s for n, s in shapes.items() if -1 in pinned_shape(s[0], s[2])}


def check_bundle(manifest) -> None:
    """Refuse bundles whose graphs TensorRT's parser cannot read (weight-only MatMulNBits) or whose attention
    its TreeAttention plugin does not compute (sliding windows, softcapped scores)."""
    q = manifest.artifacts.get("quantization")
    if q:
        raise SpecrtError(f"this bundle was exported with --quantize {q.get('scheme', '')} (com.microsoft."
                          "MatMulNBits, an ONNX Runtime CPU op TensorRT cannot parse): export it again "
                          "without --quantize for TensorRT")
    windows = manifest.target.config.layer_windows
    if any(windows):  # the Triton TreeAttention plugin has no window; the windowed body is untested there
        raise SpecrtError(f"this bundle's target has sliding-window attention (layer windows {sorted(set(windows))}),"
                          " which the TensorRT TreeAttention plugin does not implement: use --backend ort")
    cap = manifest.target.config.attn_logit_softcapping
    if cap:  # the Triton TreeAttention kernel has no softcap either
        raise SpecrtError(f"this bundle's target softcaps attention scores (attn_logit_softcapping {cap:g}), which "
                          "the TensorRT TreeAttention plugin does not implement: use --backend ort")


def engine_file(graph_file: str, precision: str) -> str:
    """'target/decoder.onnx' → 'target/decoder.fp16.engine' (relative to the bundle)."""
    p = PurePosixPath(graph_file)
    return str(p.with_name(f"{p.stem}.{precision}.engine"))


def manifest_entry(trt_version: str, precision: str, capacity: int, max_window: int, graphs: dict) -> dict:
    """`manifest.artifacts["tensorrt"]`. graphs: role → {"file", "profile", "seconds"}."""
    if precision not in PRECISIONS:
        raise SpecrtError(f"unknown TensorRT precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    return {
        "tensorrt": str(trt_version),
        "precision": precision,
        "capacity": int(capacity),
        "max_window": int(max_window),
        "batch": 1,
        "parser_flags": [PARSER_FLAG],
        "plugins": {"namespace": PLUGIN_NAMESPACE, "version": PLUGIN_VERSION, "ops": list(PLUGIN_OPS)},
        "timing_cache": TIMING_CACHE,
        "graphs": {role: {"file": g["file"], "seconds": g.get("seconds"),
                          "profile": {n: [list(s) for s in shp] for n, shp in g["profile"].items()}}
                   for role, g in graphs.items()},
    }


def plan_chunks(tree_mask: np.ndarray, logits_index: np.ndarray, max_window: int) -> list[tuple[int, int]]:
    """Split a window of T tokens into passes of at most max_window tokens: [(start, end), ...].

    A window that fits is one pass. A longer one must be a plain causal prefill (tree_mask lower
    triangular, so each chunk sees the earlier ones through the KV cache) whose logits rows all lie
    in the last chunk; anything else is refused rather than computed wrongly.
    """
    t = tree_mask.shape[-1]
    if t <= max_window:
        return [(0, t)]
    causal = np.tril(np.ones((t, t), bool))
    if not np.array_equal(np.broadcast_to(causal, tree_mask.shape), tree_mask.astype(bool)):
        raise SpecrtError(f"a drafted tree of {t} nodes exceeds the TensorRT engines' window ({max_window}): "
                          f"rebuild with a larger window or draft fewer tokens")
    bounds = [(s, min(s + max_window, t)) for s in range(0, t, max_window)]
    if int(np.min(logits_index)) < bounds[-1][0]:
        raise SpecrtError(f"logits rows {np.unique(logits_index).tolist()[:8]} fall outside the last prefill "
                          f"chunk [{bounds[-1][0]}, {t}) of the TensorRT engine")
    return bounds
