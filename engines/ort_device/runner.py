"""ONNX Runtime with everything on a device: `OrtDeviceDecoder`, the CUDA twin of `OrtDecoder`.

- The KV cache is allocated once as device OrtValues ([B, KV, capacity, d] fp32 per layer and kind,
  zeroed) and bound as both `past_*` input and `present_*` output: the graph's TensorScatter writes
  the new rows straight into it, as on the CPU path.
- One bucket per input-shape signature (window T, logits rows R, extra inputs): device buffers for
  every per-step input and output, allocated once, with the KV bound beside them in the bucket's own
  IOBinding. A step copies its inputs into the bucket's buffers (`OrtValue.update_inplace`), runs, and
  reads the outputs back to host numpy. Fixed addresses are what ORT's CUDA graphs need; the same
  code runs on the CPU provider (device "cpu"), which is how all of it is tested here.
- `compact` moves KV rows on the device with a tiny ONNX graph built once (per buffer: Gather the
  accepted rows along the sequence axis, TensorScatter them at dst, bound in place like the decoder).
- CUDA graphs (device "cuda"): the provider option `enable_cuda_graph` plus one run option
  `gpu_graph_id` per bucket (ORT keeps one captured graph per id, ids >= 1; -1 runs without
  capture; ORT warms up and captures by itself on an id's first runs). The exported decoder reads its
  attended length from data (L = max(past_len) + T, and the column split at min(past_len), see
  plugins/tree_attention.py), which a captured graph would freeze, so with graphs on the bucket key
  also holds max(past_len) and min(past_len) (`bucket_key`): a
  replay then sees the very shapes it captured (correct by construction), and pays off only when a
  (T, R, max past_len) repeats (e.g. the same prompt again) until a static-length decoder variant is
  exported. (TensorRT needs no such key: its attention plugin reads past_len at run time, see
  engines/trt/runner.py `graph_key`.)

NEVER RUN in this workplace: the lines marked "never run here (no GPU)" (the CUDA provider, device
OrtValues on CUDA, graph capture). Everything else runs and is tested on the CPU provider.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.engines.decoder import Decoder
from specrt.engines.ort_cpu.runner import session_options
from specrt.errors import SpecrtError
from specrt.plugins.onnx_builder import FLOAT, INT64, GraphBuilder
from specrt.schema.config import DecoderConfig

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
CUDA_HINT = ("ONNX Runtime's CUDA provider is not available here: `pip install onnxruntime-gpu` "
             "(in place of onnxruntime) on a machine with an NVIDIA CUDA GPU")
DTYPES = {"tensor(int64)": np.int64, "tensor(bool)": np.bool_, "tensor(float)": np.float32}
MAX_BUCKETS = 64  # beyond this, new shapes run uncaptured in a scratch bucket (no unbounded growth)
NO_GRAPH = -1  # ORT's gpu_graph_id for "run without capture or replay"


def require_device(device: str) -> str:
    """The execution provider for `device`, or one line saying what to install."""
    if device not in PROVIDERS:
        raise SpecrtError(f"unknown ONNX Runtime device {device!r}: use one of {', '.join(PROVIDERS)}")
    provider = PROVIDERS[device]
    if provider not in ort.get_available_providers():
        raise SpecrtError(CUDA_HINT)
    return provider


def _providers(device: str, cuda_graphs: bool) -> list:
    provider = require_device(device)
    if device == "cuda":  # never run here (no GPU)
        return [(provider, {"device_id": 0, "enable_cuda_graph": "1" if cuda_graphs else "0"})]
    return [provider]


def _session(model: Path | bytes, so: ort.SessionOptions, providers: list, device: str,
             what: str) -> ort.InferenceSession:
    try:
        session = ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=providers)
    except Exception as e:  # ORT raises its own Fail/InvalidGraph types
        raise SpecrtError(f"cannot load {what} on {device}: {str(e).splitlines()[0][:300]}"
                          " — export the bundle again (or pass cuda_graphs=False)") from None
    if PROVIDERS[device] not in session.get_providers():  # never run here (no GPU): ORT fell back to CPU
        raise SpecrtError(CUDA_HINT)
    return session


def compact_model(num_buffers: int, shape: tuple[int, ...]) -> bytes:
    """The KV compaction graph: for each buffer i and sequence b, rows rows[b] moved to dst[b].. in place.

        rows [B, R] ─► Expand to [B, KV, R, d]
        kv.i [B, KV, S, d] ─► GatherElements(that, axis=2) ─► [B, KV, R, d]
        kv.i, that, dst [B] ─► TensorScatter(axis=2) ═► kv_out.i  (bound to kv.i's memory)

    A sequence left alone gets rows[b] = dst[b] .. dst[b]+R-1: its rows are written onto themselves.
    """
    g = GraphBuilder("kv_compact")
    batch, heads, _, dim = shape
    rows = g.input("rows", INT64, [batch, "rows"])
    dst = g.input("dst", INT64, [batch])
    r = g.op("Shape", rows, start=1, end=2)
    index_shape = g.op("Concat", g.const([batch, heads]), r, g.const([dim]), axis=0)
    index = g.op("Expand", g.op("Unsqueeze", rows, g.const([1, 3])), index_shape)
    for i in range(num_buffers):
        with g.scope(f"kv.{i}"):
            buf = g.input(f"kv.{i}", FLOAT, list(shape))
            moved = g.op("GatherElements", buf, index, axis=2)
            g.op("TensorScatter", buf, moved, dst, axis=2, out_names=[f"kv_out.{i}"])
            g.output(f"kv_out.{i}", f"kv_out.{i}", FLOAT, list(shape))
    return g.model("specrt KV compaction: accepted tree rows moved next to the prefix, in place").SerializeToString()


def bucket_key(slots: tuple[int, int], feeds: dict[str, np.ndarray], past_len: np.ndarray,
               cuda_graphs: bool) -> tuple:
    """The bucket (IOBinding, fixed buffers, graph id) a pass runs in: the KV slots it binds (their
    addresses), every input's name and shape and, with CUDA graphs, the attended length max(past_len)
    and the shortest prefix min(past_len).

    ORT captures a graph with every input at a fixed address and shape and replays its kernels as
    launched, without running the graph's shape computations again. Input values are copied into
    the fixed buffers before each run, so values the graph only computes with (past_len in the mask
    and the TensorScatter of the new KV rows, the tree mask, the ids) may change between replays.
    Shapes taken from values may not: the decoder's attention (the TreeAttention function body,
    plugins/tree_attention.py) sizes its Range, mask and K/V Slice with L = max(past_len) + T, and
    splits the columns at the shortest prefix min(past_len), so a replay at another max or min would
    attend over the captured lengths. T is in the input shapes; max and min of past_len are the
    value-derived sizes, so they are in the key when graphs are on (each sequence's own past_len is
    data otherwise: batch 1, or a batch with the same longest and shortest lengths, reuses the graph).
    Without graphs ORT runs shape inference every run: shapes and slots suffice."""
    key = (slots, *((n, tuple(v.shape)) for n, v in feeds.items()))
    return key + (int(np.max(past_len)), int(np.min(past_len))) if cuda_graphs else key


@dataclass
class _Bucket:
    """One input-shape signature: its IOBinding, fixed device buffers and CUDA graph id."""

    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    run_options: ort.RunOptions


class OrtDeviceDecoder(Decoder):
    """A decoder graph with its own device KV cache of `capacity` rows per sequence (ORT, CPU or CUDA).

    Same interface as `OrtDecoder` (`run_all`, `run`, `compact`, `capacity`, `cfg`, `batch`,
    `session`); `kv` holds OrtValues, `kv_arrays()` copies them to host numpy.
    """

    def __init__(self, path: Path, cfg: DecoderConfig, capacity: int, threads: int = 2, batch: int = 1,
                 spin: bool = True, device: str = "cpu", cuda_graphs: bool | None = None):
        path = Path(path)
        if not path.is_file():
            raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
        cuda_graphs = device == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if cuda_graphs and device != "cuda":
            raise SpecrtError(f"CUDA graphs need device 'cuda', not {device!r}: pass cuda_graphs=False")
        so = session_options(threads, spin)
        self.session = _session(path, so, _providers(device, cuda_graphs), device, f"ONNX graph {path}")
        self.path, self.cfg, self.capacity, self.batch = path, cfg, int(capacity), int(batch)
        self.device, self.cuda_graphs = device, cuda_graphs
        shape = (self.batch, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        self.kv = [self._zeros(shape) for _ in range(2 * cfg.num_layers)]
        kv_prefix = ("past_key.", "past_value.", "present_key.", "present_value.")
        self.inputs = {i.name: i for i in self.session.get_inputs() if not i.name.startswith(kv_prefix)}
        self.outputs = {o.name: o for o in self.session.get_outputs() if not o.name.startswith(kv_prefix)}
        self.output_names = list(self.outputs)
        self.slots = (0, self.batch)  # the sequences the next passes run over (see `select`)
        self._buckets: dict[tuple, _Bucket] = {}
        self._next_graph_id = 1  # ORT reserves 0 for its single default graph
        # the compaction graph: same provider, never captured (it runs once per accepted tree step)
        self._compact = _session(compact_model(len(self.kv), shape), so, _providers(device, False), device,
                                 "the KV compaction graph")
        self._compact_binding = self._compact.io_binding()
        for i, buf in enumerate(self.kv):
            self._compact_binding.bind_ortvalue_input(f"kv.{i}", buf)
            self._compact_binding.bind_ortvalue_output(f"kv_out.{i}", buf)

    def _zeros(self, shape, dtype=np.float32) -> ort.OrtValue:
        """A device buffer, zeroed (fresh ORT allocations hold garbage; masked-out KV rows must be finite)."""
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype, self.device, 0)
        value.update_inplace(np.zeros(shape, dtype))
        return value

    # ── buckets ──────────────────────────────────────────────────────────────────────────────────
    def _dims(self, dims, sizes: dict[str, int]) -> tuple[int, ...] | None:
        """Concrete shape of a graph output for this step; None when a dim is not known up front."""
        out = []
        for d in dims:
            if isinstance(d, int):
                out.append(d)
            elif d in sizes:
                out.append(sizes[d])
            else:
                return None
        return tuple(out)

    def _new_bucket(self, feeds: dict[str, np.ndarray], graph_id: int) -> _Bucket:
        binding = self.session.io_binding()
        b, t = feeds["input_ids"].shape
        sizes = {"batch": b, "tokens": t, "rows": feeds["logits_index"].shape[1]}
        outputs = {}
        for name, info in self.outputs.items():
            shape = self._dims(info.shape, sizes)
            if shape is None:  # ORT allocates it each run: fine eagerly, not capturable
                binding.bind_output(name, self.device)
                graph_id = NO_GRAPH
            else:
                outputs[name] = self._zeros(shape, DTYPES[info.type])
                binding.bind_ortvalue_output(name, outputs[name])
        # the KV after the other outputs, so get_outputs() lists those first, in output_names order;
        # bound by address: sequences start..stop-1 of each buffer are one contiguous block
        start, stop = self.slots
        shape = [stop - start, self.cfg.num_kv_heads, self.capacity, self.cfg.head_dim]
        offset = start * int(np.prod(shape[1:])) * 4  # fp32
        for i in range(self.cfg.num_layers):
            for j, kind in enumerate(("key", "value")):
                ptr = self.kv[2 * i + j].data_ptr() + offset
                binding.bind_input(f"past_{kind}.{i}", self.device, 0, np.float32, shape, ptr)
                binding.bind_output(f"present_{kind}.{i}", self.device, 0, np.float32, shape, ptr)
        inputs = {}
        for name, value in feeds.items():
            inputs[name] = self._zeros(value.shape, value.dtype)
            binding.bind_ortvalue_input(name, inputs[name])
        options = ort.RunOptions()
        if self.cuda_graphs:  # never run here (no GPU): one captured graph per bucket
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return _Bucket(binding, inputs, outputs, options)

    def _bucket(self, feeds: dict[str, np.ndarray], past_len: np.ndarray) -> _Bucket:
        key = bucket_key(self.slots, feeds, past_len, self.cuda_graphs)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:  # full: run uncaptured, keep no buffers for this shape
                return self._new_bucket(feeds, NO_GRAPH)
            graph_id = self._next_graph_id if self.cuda_graphs else NO_GRAPH
            self._next_graph_id += self.cuda_graphs
            bucket = self._buckets[key] = self._new_bucket(feeds, graph_id)
        return bucket

    # ── OrtDecoder's interface ─────────────────────────────────────────────────────────────────────
    def output_shape(self, name: str) -> tuple | None:
        """The graph's shape of output `name` (dynamic axes by name); None when it has no such output."""
        return tuple(self.outputs[name].shape) if name in self.outputs else None

    def select(self, start: int, stop: int) -> None:
        """Make the next passes run over sequence slots start..stop-1 (their inputs have batch stop-start)."""
        self.check_slots(start, stop)
        self.slots = (start, stop)

    def run_all(self, input_ids: np.ndarray, position_ids: np.ndarray, past_len: np.ndarray,
                tree_mask: np.ndarray, logits_index: np.ndarray, **extra: np.ndarray) -> dict[str, np.ndarray]:
        """One forward pass; every non-KV output by name, as host numpy arrays."""
        self.check_rows(past_len, input_ids.shape[1])
        given = {"input_ids": input_ids, "position_ids": position_ids, "past_len": past_len,
                 "tree_mask": tree_mask, "logits_index": logits_index, **extra}
        missing = [n for n in self.inputs if n not in given]
        if missing:
            raise SpecrtError(f"ONNX graph {self.path.name} needs inputs {missing}: pass them to run()")
        feeds = {n: np.ascontiguousarray(given[n], DTYPES[self.inputs[n].type]) for n in self.inputs}
        bucket = self._bucket(feeds, past_len)
        for name, value in feeds.items():
            bucket.inputs[name].update_inplace(value)
        self.session.run_with_iobinding(bucket.binding, bucket.run_options)
        values = dict(zip(self.output_names, bucket.binding.get_outputs(), strict=False))
        # copy: on the CPU provider .numpy() is a view of the bucket's buffer, rewritten next step
        return {name: np.array(values[name].numpy(), copy=True) for name in self.output_names}

    def compact(self, dst: int, rows: list[int], slot: int | None = None) -> None:
        """Move KV rows `rows` (accepted tree nodes, ascending, >= dst) to dst, dst+1, ... in every
        layer, in sequence `slot` (default: every sequence), on the device (all rows are read before
        any is written)."""
        index = np.broadcast_to(np.asarray(rows, np.int64), (self.batch, len(rows))).copy()
        if slot is not None:  # the other sequences move their rows dst.. onto themselves
            if not 0 <= slot < self.batch:
                raise SpecrtError(f"internal: slot {slot} outside the cache's {self.batch}")
            keep = np.arange(dst, dst + len(rows), dtype=np.int64)
            index[np.arange(self.batch) != slot] = keep
        b = self._compact_binding
        b.bind_cpu_input("rows", index)
        b.bind_cpu_input("dst", np.full(self.batch, dst, np.int64))
        self._compact.run_with_iobinding(b)

    @property
    def num_buckets(self) -> int:
        """Input-shape signatures seen so far, each with its own fixed buffers (and CUDA graph)."""
        return len(self._buckets)

    def kv_arrays(self) -> list[np.ndarray]:
        """The KV buffers copied to host numpy (tests, debugging): [past_key.0, past_value.0, ...]."""
        return [np.array(v.numpy(), copy=True) for v in self.kv]
