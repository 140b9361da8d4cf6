"""A small ONNX graph builder: deterministic hierarchical names, numpy initializers, int constants.

Each `op()` call adds one node named `<scope>/<OpType>` (made unique) and returns its output
name(s), so graph code reads like the maths it implements.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24  # TensorScatter (in-place KV update) arrived in opset 24


class GraphBuilder:
    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._used: Counter[str] = Counter()
        self._consts: dict[tuple, str] = {}

    @contextmanager
    def scope(self, name: str):
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def _unique(self, base: str) -> str:
        self._used[base] += 1
        n = self._used[base]
        return base if n == 1 else f"{base}_{n - 1}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None,
           out_names: list[str] | None = None, **attrs):
        """Add a node; `out_names` gives outputs fixed names (graph outputs written in place)."""
        node_name = self._unique("/" + "/".join([*self._scope, name or op_type]))
        outs = out_names or [f"{node_name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, **attrs))
        return outs[0] if outputs == 1 else outs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small constant initializer, shared by value (e.g. axes, shapes, scalars)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            self._consts[key] = self.weight(f"const_{len(self._consts)}", arr)
        return self._consts[key]

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: list) -> None:
        """Declare a graph output; `value` is renamed through an Identity unless it is `name` already."""
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=f"/output/{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def model(self, doc: str = "") -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="specrt", doc_string=doc)
        model.ir_version = 11
        return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL
