"""TensorRT backend: `TrtDecoder`, the GPU twin of `OrtDecoder` (same `run`, `run_all`, `compact`, `kv`,
`capacity`, `cfg`).

NEVER RUN in this workplace (no TensorRT, no GPU): written against TensorRT's documented
IExecutionContext API (`set_input_shape`, `set_tensor_address`, `execute_async_v3`) and torch's
CUDA graphs; unverified until it runs on a GPU machine. Importing this module needs neither.

- The engine (built by `specrt build --backend trt`) is deserialized once, after specrt's plugins
  are registered.
- The KV cache is allocated once on the device (torch CUDA tensors, [1, KV, capacity, d] fp32 per
  layer and kind) and bound by address as both `past_*` and `present_*`: the engine's in-place KV
  update writes the new rows straight into it.
- One bucket per (window T, logits rows R, extra inputs): its own execution context with the input
  shapes set once, static device buffers for every input and output bound once, and a CUDA graph.
  A step copies its inputs into the bucket's buffers, then replays the graph; a bucket's first step
  runs eagerly (TensorRT's warm-up) and then records the graph. A context per bucket (not one shared
  context) because a graph bakes in the shapes and addresses the context had when it was recorded;
  it is recorded again only if the KV buffers' addresses change.
- A window longer than the engine's profile (a long prompt's prefill) runs as several causal passes
  (`trt_profiles.plan_chunks`); the engine's window is `manifest.artifacts["tensorrt"]["max_window"]`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.engines.decoder import Decoder
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig

CUDA_HINT = "the TensorRT runtime needs torch with CUDA and a visible NVIDIA GPU: `pip install torch` (a CUDA build)"
MAX_BUCKETS = 32  # oldest bucket (context + graph + buffers) dropped beyond this


def _require_cuda_torch():
    try:
        import torch
    except ImportError:
        raise SpecrtError(CUDA_HINT) from None
    if not torch.cuda.is_available():
        raise SpecrtError(CUDA_HINT)
    return torch


def graph_key(feeds: dict[str, np.ndarray]) -> tuple:
    """The bucket (context + CUDA graph) a pass runs in: its input names and shapes, not their values.

    Shapes are all a recorded graph bakes in besides addresses: every input, `past_len` included, is
    a device buffer the step overwrites before each replay, and nothing in the engine takes a shape
    from `past_len`'s value. Attention is the TreeAttention plugin (plugins/tensorrt_plugins.py,
    swapped in for the ONNX function body by ENABLE_PLUGIN_OVERRIDE): its grid is (T, B·H), from
    shapes, and its kernel loads past_len from device memory and loops over the valid rows at run
    time; the KV update (TensorScatter at past_len) takes it as data. So one graph serves every
    past_len. (The KV buffers' addresses are checked apart, in `_pass`.) Were the function body
    built instead of the plugin, past_len would size its Range/Slice (L = max(past_len) + T) and
    TensorRT would make it a host shape input (`engine.is_shape_inference_io("past_len")`), which
    this runner, binding a device buffer, does not support with or without graphs."""
    return tuple((n, tuple(feeds[n].shape)) for n in sorted(feeds))


class _Bucket:
    """One (T, R, extras) shape: its execution context, static device buffers and CUDA graph."""

    def __init__(self, context, inputs: dict, outputs: dict):
        self.context, self.inputs, self.outputs = context, inputs, outputs
        self.graph = None
        self.kv_ptrs: tuple = ()


class TrtDecoder(Decoder):
    """A decoder engine with its own device KV cache of `capacity` rows (batch 1)."""

    def __init__(self, engine_path: Path, cfg: DecoderConfig, capacity: int, max_window: int,
                 cuda_graphs: bool = True):
        from specrt.engines.trt.build import require_recent_tensorrt
        from specrt.plugins.tensorrt_plugins import register_plugins

        trt = require_recent_tensorrt()
        torch = _require_cuda_torch()
        engine_path = Path(engine_path)
        if not engine_path.is_file():
            raise SpecrtError(f"TensorRT engine {engine_path} is missing: run `specrt build --backend trt` on this bundle")
        register_plugins(max_window=max_window)
        self._trt, self._torch = trt, torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise SpecrtError(f"cannot load TensorRT engine {engine_path}: built by another TensorRT version or GPU? "
                              "run `specrt build --backend trt` again")
        self.path, self.cfg, self.capacity, self.max_window = engine_path, cfg, int(capacity), int(max_window)
        self.batch, self.cuda_graphs = 1, cuda_graphs
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        is_input = {n: self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT for n in names}
        kv = ("past_key.", "past_value.", "present_key.", "present_value.")  # not past_len
        self.input_names = [n for n in names if is_input[n] and not n.startswith(kv)]
        self.output_names = [n for n in names if not is_input[n] and not n.startswith(kv)]
        shape = (1, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        self.kv = [torch.zeros(shape, dtype=torch.float32, device="cuda") for _ in range(2 * cfg.num_layers)]
        self.stream = torch.cuda.Stream()
        self._buckets: dict[tuple, _Bucket] = {}

    # ── buckets ──────────────────────────────────────────────────────────────────────────────────
    def _dtype(self, name: str):
        return self._torch.from_numpy(np.empty(0, self._trt.nptype(self.engine.get_tensor_dtype(name)))).dtype

    def _kv_bindings(self) -> dict[str, int]:
        out = {}
        for i in range(self.cfg.num_layers):
            for j, kind in enumerate(("key", "value")):
                ptr = self.kv[2 * i + j].data_ptr()
                out[f"past_{kind}.{i}"] = out[f"present_{kind}.{i}"] = ptr
        return out

    def _bucket(self, feeds: dict[str, np.ndarray]) -> _Bucket:
        key = graph_key(feeds)
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._new_bucket(feeds)
            if len(self._buckets) >= MAX_BUCKETS:
                self._buckets.pop(next(iter(self._buckets)))
            self._buckets[key] = bucket
        return bucket

    def _new_bucket(self, feeds: dict[str, np.ndarray]) -> _Bucket:
        torch = self._torch
        context = self.engine.create_execution_context()
        inputs = {}
        for name, value in feeds.items():
            inputs[name] = torch.empty(value.shape, dtype=self._dtype(name), device="cuda")
            if not context.set_input_shape(name, tuple(value.shape)):
                raise SpecrtError(f"TensorRT engine {self.path.name} refuses {name} of shape {value.shape} "
                                  f"(built for windows up to {self.max_window}): rebuild with a larger window")
        for name, ptr in self._kv_bindings().items():
            context.set_tensor_address(name, ptr)
        outputs = {name: torch.empty(tuple(context.get_tensor_shape(name)), dtype=self._dtype(name), device="cuda")
                   for name in self.output_names}
        for name, buf in {**inputs, **outputs}.items():
            context.set_tensor_address(name, buf.data_ptr())
        bucket = _Bucket(context, inputs, outputs)
        bucket.kv_ptrs = tuple(t.data_ptr() for t in self.kv)
        return bucket

    def _capture(self, bucket: _Bucket, kv_ptrs: tuple) -> None:
        """Record the bucket's pass as a CUDA graph (recording runs nothing). Called right after an
        eager pass of the same bucket, which is also the warm-up TensorRT wants before a capture."""
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                self._enqueue(bucket)
        except RuntimeError:  # an engine CUDA graphs cannot capture: run eagerly from now on
            self.cuda_graphs = False
            torch.cuda.synchronize()
            return
        bucket.graph, bucket.kv_ptrs = graph, kv_ptrs

    def _enqueue(self, bucket: _Bucket) -> None:
        if not bucket.context.execute_async_v3(self._torch.cuda.current_stream().cuda_stream):
            raise SpecrtError(f"TensorRT engine {self.path.name} failed to run (see its log above)")

    def _pass(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self._torch
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise SpecrtError(f"TensorRT engine {self.path.name} needs inputs {missing}: pass them to run()")
        bucket = self._bucket(feeds)
        kv_ptrs = tuple(t.data_ptr() for t in self.kv)
        with torch.cuda.stream(self.stream):
            for name, value in feeds.items():  # the step's inputs first: every pass reads real data
                bucket.inputs[name].copy_(torch.from_numpy(np.ascontiguousarray(value)))
            if bucket.graph is not None and bucket.kv_ptrs == kv_ptrs:
                bucket.graph.replay()
            else:
                if bucket.kv_ptrs != kv_ptrs:  # KV buffers moved: bind them again before running
                    for name, ptr in self._kv_bindings().items():
                        bucket.context.set_tensor_address(name, ptr)
                    bucket.graph, bucket.kv_ptrs = None, kv_ptrs
                self._enqueue(bucket)  # this step's pass, and the warm-up before a capture
                if self.cuda_graphs:
                    self._capture(bucket, kv_ptrs)
            outs = {name: buf.to("cpu", non_blocking=False) for name, buf in bucket.outputs.items()}
        self.stream.synchronize()
        return {name: t.numpy() for name, t in outs.items()}

    # ── OrtDecoder's interface ─────────────────────────────────────────────────────────────────────
    def output_shape(self, name: str) -> tuple[int, ...] | None:
        """The engine's shape of output `name` (-1: a dynamic axis); None when it has no such output."""
        return tuple(self.engine.get_tensor_shape(name)) if name in self.output_names else None

    def run_all(self, input_ids: np.ndarray, position_ids: np.ndarray, past_len: np.ndarray,
                tree_mask: np.ndarray, logits_index: np.ndarray, **extra: np.ndarray) -> dict[str, np.ndarray]:
        """One forward pass (several for a prefill longer than the engine's window); every non-KV output."""
        from specrt.engines.trt.profiles import plan_chunks

        if input_ids.shape[0] != 1:
            raise SpecrtError(f"the TensorRT engines run batch 1, got batch {input_ids.shape[0]}")
        end = int(past_len.max()) + input_ids.shape[1]
        if end > self.capacity:
            raise SpecrtError(f"KV capacity {self.capacity} exceeded ({end} rows): raise --max-seq-len")
        chunks = plan_chunks(tree_mask, logits_index, self.max_window)
        per_token: dict[str, list[np.ndarray]] = {}
        outs: dict[str, np.ndarray] = {}
        for s, e in chunks:
            last = e == chunks[-1][1]
            feeds = {"input_ids": input_ids[:, s:e].astype(np.int64), "position_ids": position_ids[:, s:e].astype(np.int64),
                     "past_len": (past_len + s).astype(np.int64), "tree_mask": tree_mask[:, s:e, s:e].astype(bool),
                     "logits_index": (logits_index - s if last else np.zeros((1, 1), logits_index.dtype)).astype(np.int64),
                     **{k: np.asarray(v[:, s:e], np.float32) for k, v in extra.items()}}
            outs = self._pass({k: v for k, v in feeds.items() if k in self.input_names})
            for name, value in outs.items():
                if name != "logits":  # contract: logits are per row, every other output per token
                    per_token.setdefault(name, []).append(value)
        if len(chunks) > 1:
            outs.update({name: np.concatenate(parts, axis=1) for name, parts in per_token.items()})
        return outs

    def compact(self, dst: int, rows: list[int], slot: int | None = None) -> None:
        """Move KV rows `rows` (accepted tree nodes, ascending) to dst, dst+1, ... in every layer, on the GPU
        (batch 1: `slot` is None or 0)."""
        if slot not in (None, 0):
            raise SpecrtError(f"internal: the TensorRT decoder holds one sequence, not slot {slot}")
        torch = self._torch
        with torch.cuda.stream(self.stream):
            src = torch.as_tensor(rows, dtype=torch.long, device="cuda")
            for buf in self.kv:
                buf[:, :, dst : dst + len(rows)] = buf.index_select(2, src)
        self.stream.synchronize()
