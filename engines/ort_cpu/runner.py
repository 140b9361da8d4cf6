"""ONNX Runtime backend: one decoder session, KV buffers preallocated once, bound in place.

The KV buffers are numpy arrays wrapped as OrtValues and bound as both `past_*` input and
`present_*` output, so the graph's TensorScatter writes the new rows straight into them: no copy of
the cache per step. The per-pass inputs and outputs are bound the same way, to buffers of their own
kept while their shapes hold: a plain decoding step (the same shapes every pass) copies its five small
inputs in, binds nothing and asks ONNX Runtime for no allocation of its own. An output buffer is handed
to the caller as it is; the next pass writes into it again only once nothing refers to it any more
(the caller dropped the pass's outputs, as the decoding loop does), else it gets a new buffer, bound
for it: what a pass returned is never overwritten. (A fresh output array every pass measured slower:
the allocator maps and faults in the logits' pages each time.)

A graph whose passes write KV rows past their window (`ort-fused`'s attention pad row: its metadata
`specrt.kv_pad_rows`, engines/ort_cpu/fuse.py) gets that many more rows per buffer; `capacity`, the
rows a window may reach, is unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.engines.decoder import Decoder, compact_host_kv
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig


def session_options(threads: int, spin: bool = True) -> ort.SessionOptions:
    """`spin=False` for the small drafter graphs: their idle worker threads must not spin-wait and
    steal the two cores from the target's pass (ORT's workers spin after each run by default)."""
    so = ort.SessionOptions()
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return so


def kv_pad_rows(session: ort.InferenceSession) -> int:
    """KV rows a pass of this graph writes past its window (0 unless its metadata says)."""
    from specrt.engines.ort_cpu.fuse import KV_PAD_ROWS

    return int(session.get_modelmeta().custom_metadata_map.get(KV_PAD_ROWS, 0))


class OrtDecoder(Decoder):
    """A decoder graph with its own KV cache of `capacity` rows per sequence.

    Any graph following the contract works: the target and draft LMs, and the learned drafters'
    layers (which take extra inputs such as `hidden_in`, passed to `run` by name).
    """

    def __init__(self, path: Path, cfg: DecoderConfig, capacity: int, threads: int = 2, batch: int = 1,
                 spin: bool = True):
        if not Path(path).is_file():
            raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
        try:
            self.session = ort.InferenceSession(str(path), session_options(threads, spin),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own Fail/InvalidGraph types
            raise SpecrtError(f"cannot load ONNX graph {path}: {str(e).splitlines()[0][:300]} — export the bundle again") from None
        self.path, self.cfg, self.capacity, self.batch = Path(path), cfg, capacity, batch
        shape = (batch, cfg.num_kv_heads, capacity + kv_pad_rows(self.session), cfg.head_dim)
        self.kv = [np.zeros(shape, np.float32) for _ in range(2 * cfg.num_layers)]
        self.binding = self.session.io_binding()
        # outputs other than the KV buffers, bound first so get_outputs() lists them in this order
        outputs = [o for o in self.session.get_outputs() if not o.name.startswith("present_")]
        self.output_names = [o.name for o in outputs]
        self._output_shapes = {o.name: tuple(o.shape) for o in outputs}
        self._output_types = {o.name: o.type for o in outputs}
        self._input_dims = {i.name: tuple(i.shape) for i in self.session.get_inputs()}
        self._inputs: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # name -> (its buffer, bound over it)
        # name -> (the buffer bound as that output, its reference count while only this runner holds it)
        self._outputs: dict[str, list] = {}
        self._out_shapes: list[tuple | None] | None = None  # each output's shape for the bound inputs (None: unknown)
        for name in self.output_names:
            self.binding.bind_output(name)
        self._views: dict[tuple[int, int], list] = {}
        self.slots = (0, batch)
        self._bind_kv(0, batch)

    def output_shape(self, name: str) -> tuple | None:
        """The graph's shape of output `name` (dynamic axes by name); None when it has no such output."""
        return self._output_shapes.get(name)

    def _bind_kv(self, start: int, stop: int) -> None:
        """Bind sequence slots start..stop-1 of every KV buffer (a contiguous view: no copy) as the
        pass's batch; the OrtValues of each range are made once."""
        if (start, stop) not in self._views:
            self._views[(start, stop)] = [ort.OrtValue.ortvalue_from_numpy(buf[start:stop]) for buf in self.kv]
        values = self._views[(start, stop)]
        for i in range(self.cfg.num_layers):
            for j, kind in enumerate(("key", "value")):
                self.binding.bind_ortvalue_input(f"past_{kind}.{i}", values[2 * i + j])
                self.binding.bind_ortvalue_output(f"present_{kind}.{i}", values[2 * i + j])

    def select(self, start: int, stop: int) -> None:
        """Make the next passes run over sequence slots start..stop-1 (their inputs have batch stop-start)."""
        self.check_slots(start, stop)
        if (start, stop) != self.slots:
            self._bind_kv(start, stop)
            self.slots = (start, stop)

    def run_all(self, input_ids: np.ndarray, position_ids: np.ndarray, past_len: np.ndarray,
                tree_mask: np.ndarray, logits_index: np.ndarray, **extra: np.ndarray) -> dict[str, np.ndarray]:
        """One forward pass; every non-KV output by name (e.g. aux_hidden_states), arrays of the caller's own."""
        end = int(past_len.max()) + input_ids.shape[1]
        if end > self.capacity:
            self.check_rows(past_len, input_ids.shape[1])  # raises, naming the fix
        # the step's own inputs copied into their bound buffers; `resized`: one of them changed shape
        resized = self._set_input("input_ids", input_ids) | self._set_input("position_ids", position_ids)
        resized |= self._set_input("past_len", past_len) | self._set_input("tree_mask", tree_mask)
        resized |= self._set_input("logits_index", logits_index)
        for name, value in extra.items():
            resized |= self._set_input(name, np.asarray(value, np.float32))
        if resized or self._out_shapes is None:  # the outputs' shapes for these inputs
            dims = {d: n for name, (buf, _) in self._inputs.items()
                    for d, n in zip(self._input_dims.get(name, ()), buf.shape, strict=False) if isinstance(d, str)}
            self._out_shapes = [self._output_dims(name, dims) for name in self.output_names]
        out = {name: self._bind_output(name, shape) for name, shape in zip(self.output_names, self._out_shapes, strict=True)}
        self.session.run_with_iobinding(self.binding)
        if any(buf is None for buf in out.values()):  # the non-KV outputs were bound first: get_outputs() lists them first
            b = self.binding
            fetched = b._iobinding.get_outputs() if hasattr(b, "_iobinding") else b.get_outputs()
            out = {name: fetched[i].numpy() if buf is None else buf for i, (name, buf) in enumerate(out.items())}
        return out

    def _set_input(self, name: str, value: np.ndarray) -> bool:
        """Copy `value` into input `name`'s buffer; True when that took a new buffer (bound once), its shape
        or type having changed."""
        held = self._inputs.get(name)
        if held is not None and held[0].shape == value.shape and held[0].dtype == value.dtype:
            np.copyto(held[0], value)
            return False
        buf = np.array(value, order="C")
        ov = ort.OrtValue.ortvalue_from_numpy(buf)
        self.binding.bind_ortvalue_input(name, ov)
        self._inputs[name] = (buf, ov)
        return True

    def _output_dims(self, name: str, dims: dict[str, int]) -> tuple | None:
        """Output `name`'s shape for a pass whose named axes are `dims`; None where it is not known before
        the pass (ONNX Runtime then allocates it)."""
        if self._output_types[name] != "tensor(float)":
            return None
        shape = []
        for d in self._output_shapes[name]:
            n = d if isinstance(d, int) and d >= 0 else dims.get(d) if isinstance(d, str) else None
            if n is None:
                return None
            shape.append(n)
        return tuple(shape)

    def _bind_output(self, name: str, shape: tuple | None) -> np.ndarray | None:
        """Output `name`'s buffer for this pass: the one bound already when it has `shape` and nothing else
        refers to it (the caller dropped what the last pass returned), else a new one, bound. None: its shape
        is not known before the pass (ONNX Runtime allocates it)."""
        if shape is None:
            self.binding.bind_output(name)
            return None
        held = self._outputs.get(name)
        if held is not None and held[0].shape == shape and sys.getrefcount(held[0]) == held[1]:
            return held[0]
        held = self._outputs[name] = [np.empty(shape, np.float32), 0]
        self.binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(held[0]))
        held[1] = sys.getrefcount(held[0])  # while only this runner (and the binding) refers to it
        return held[0]

    def compact(self, dst: int, rows: list[int], slot: int | None = None) -> None:
        """Move KV rows `rows` (accepted tree nodes, ascending) to dst, dst+1, ... in every layer, in
        sequence `slot` (default: every sequence)."""
        compact_host_kv(self.kv, dst, rows, slot)
