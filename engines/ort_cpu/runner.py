"""ONNX Runtime backend: one decoder session, KV buffers preallocated once, bound in place.

The KV buffers are numpy arrays wrapped as OrtValues and bound as both `past_*` input and
`present_*` output, so the graph's TensorScatter writes the new rows straight into them: no copy of
the cache per step, no allocation on the hot path except the small per-step inputs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.engines.decoder import Decoder
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
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        self.kv = [np.zeros(shape, np.float32) for _ in range(2 * cfg.num_layers)]
        self.binding = self.session.io_binding()
        # outputs other than the KV buffers, bound first so get_outputs() lists them in this order
        outputs = [o for o in self.session.get_outputs() if not o.name.startswith("present_")]
        self.output_names = [o.name for o in outputs]
        self._output_shapes = {o.name: tuple(o.shape) for o in outputs}
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
        """One forward pass; every non-KV output by name (e.g. aux_hidden_states)."""
        self.check_rows(past_len, input_ids.shape[1])
        b = self.binding
        b.bind_cpu_input("input_ids", input_ids)
        b.bind_cpu_input("position_ids", position_ids)
        b.bind_cpu_input("past_len", past_len)
        b.bind_cpu_input("tree_mask", tree_mask)
        b.bind_cpu_input("logits_index", logits_index)
        for name, value in extra.items():
            b.bind_cpu_input(name, np.ascontiguousarray(value, np.float32))
        for name in self.output_names:
            b.bind_output(name)
        self.session.run_with_iobinding(b)
        # the non-KV outputs are bound first: read just those (get_outputs() wraps all 2·layers + n)
        values = b._iobinding.get_outputs() if hasattr(b, "_iobinding") else b.get_outputs()
        return {name: values[i].numpy() for i, name in enumerate(self.output_names)}

    def compact(self, dst: int, rows: list[int], slot: int | None = None) -> None:
        """Move KV rows `rows` (accepted tree nodes, ascending) to dst, dst+1, ... in every layer, in
        sequence `slot` (default: every sequence)."""
        src = np.asarray(rows)
        b = slice(None) if slot is None else slice(slot, slot + 1)
        for buf in self.kv:
            buf[b, :, dst : dst + len(rows)] = buf[b, :, src]
