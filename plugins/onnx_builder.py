"""A small ONNX graph builder: deterministic hierarchical names, numpy initializers, int constants.

Each `op()` call adds one node named `<scope>/<OpType>` (made unique) and returns its output
name(s), so graph code reads like the maths it implements. The same builder writes ONNX local
functions (`as_function=True`): constants become Constant nodes, since functions hold no
initializers.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24  # TensorScatter (in-place KV update) arrived in opset 24
CUSTOM_DOMAIN = "specrt"  # domain of specrt's custom ops (ONNX local functions)


class GraphBuilder:
    def __init__(self, name: str, as_function: bool = False, scope: str = ""):
        self.name = name
        self.as_function = as_function
        self.functions: dict[str, onnx.FunctionProto] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = [scope] if scope else []  # a nested body's names stay unique
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
           out_names: list[str] | None = None, domain: str = "", **attrs):
        """Add a node; `out_names` gives outputs fixed names (graph outputs written in place)."""
        node_name = self._unique("/" + "/".join([*self._scope, name or op_type]))
        outs = out_names or [f"{node_name}_output_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const(self, value, dtype=np.int64) -> str:
        """A small constant initializer, shared by value (e.g. axes, shapes, scalars)."""
        arr = np.asarray(value, dtype=dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._consts:
            if self.as_function:
                out = f"/{self.name}/const_{len(self._consts)}"  # unique across nested bodies
                self.nodes.append(helper.make_node("Constant", [], [out], name=out,
                                                   value=numpy_helper.from_array(arr)))
                self._consts[key] = out
            else:
                self._consts[key] = self.weight(f"const_{len(self._consts)}", arr)
        return self._consts[key]

    def attr_int(self, name: str) -> str:
        """Inside a function: a scalar int64 read from the calling node's attribute `name`."""
        return self._attr(name, "value_int", onnx.AttributeProto.INT)

    def attr_float(self, name: str) -> str:
        """Inside a function: a scalar float32 read from the calling node's attribute `name`."""
        return self._attr(name, "value_float", onnx.AttributeProto.FLOAT)

    def _attr(self, name: str, value: str, kind: int) -> str:
        key = ("attr", name)
        if key not in self._consts:
            out = f"/{self.name}/attr_{name}"
            node = helper.make_node("Constant", [], [out], name=out)
            node.attribute.append(onnx.AttributeProto(name=value, ref_attr_name=name, type=kind))
            self.nodes.append(node)
            self._consts[key] = out
        return self._consts[key]

    def call(self, function: onnx.FunctionProto, *inputs: str, outputs: int = 1, name: str | None = None,
             **attrs):
        """Call an ONNX local function (a specrt custom op); its definition is added to the model once."""
        self.functions.setdefault(function.name, function)
        return self.op(function.name, *inputs, outputs=outputs, name=name or function.name,
                       domain=function.domain, **attrs)

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
        opsets = [helper.make_opsetid("", OPSET)]
        if self.functions:
            opsets.append(helper.make_opsetid(CUSTOM_DOMAIN, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="specrt", doc_string=doc,
                                  functions=list(self.functions.values()))
        model.ir_version = 11
        return model

    def function(self, inputs: list[str], outputs: list[str], attributes: list[str] = (),
                 doc: str = "") -> onnx.FunctionProto:
        """This builder's nodes as an ONNX local function `specrt::<name>`."""
        return helper.make_function(CUSTOM_DOMAIN, self.name, inputs, outputs, self.nodes,
                                    opset_imports=[helper.make_opsetid("", OPSET)],
                                    attributes=list(attributes), doc_string=doc)


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
BOOL = TensorProto.BOOL
