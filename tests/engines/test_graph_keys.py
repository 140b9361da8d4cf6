"""CUDA-graph bucket keys of the GPU backends, on the CPU: what a captured graph bakes in.

- TensorRT (`graph_key`): input shapes only. past_len is a device buffer rewritten before each
  replay, and with the TreeAttention plugin in place nothing in the engine takes a shape from it.
- ONNX Runtime on a device (`bucket_key`): slots, input shapes and, with CUDA graphs, max and min
  of past_len: the TreeAttention function body sizes its attention with L = max(past_len) + T and
  splits its columns at min(past_len), which a captured graph would freeze; each sequence's own
  past_len only enters as data.

Both claims are checked on the exported graph itself by following which tensors' shapes can depend
on past_len's values (`shape_dependence`)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from specrt.engines.ort_device.runner import bucket_key
from specrt.engines.trt.runner import graph_key
from specrt.plugins import tree_attention as ta


def feeds(t: int, past: list[int], rows: int = 1, **extra) -> dict[str, np.ndarray]:
    b = len(past)
    return {"input_ids": np.zeros((b, t), np.int64), "position_ids": np.zeros((b, t), np.int64),
            "past_len": np.asarray(past, np.int64), "tree_mask": np.ones((b, t, t), bool),
            "logits_index": np.zeros((b, rows), np.int64), **extra}


# ── TensorRT ──────────────────────────────────────────────────────────────────────────────────────
def test_trt_key_is_the_input_shapes_whatever_past_len_holds():
    assert graph_key(feeds(4, [10])) == graph_key(feeds(4, [37]))
    a = feeds(4, [10])
    a["input_ids"][:] = 7  # values never matter
    assert graph_key(a) == graph_key(feeds(4, [0]))
    assert graph_key(dict(reversed(list(feeds(4, [3]).items())))) == graph_key(feeds(4, [3]))  # order-free


def test_trt_key_tells_every_shape_apart():
    base = graph_key(feeds(4, [10]))
    assert graph_key(feeds(5, [10])) != base  # window T
    assert graph_key(feeds(4, [10], rows=4)) != base  # logits rows R
    assert graph_key(feeds(4, [10], hidden_in=np.zeros((1, 4, 8), np.float32))) != base  # an extra input
    assert graph_key(feeds(4, [10], hidden_in=np.zeros((1, 4, 8), np.float32))) != \
        graph_key(feeds(4, [10], hidden_in=np.zeros((1, 4, 16), np.float32)))


# ── ONNX Runtime on a device ──────────────────────────────────────────────────────────────────────
def test_ort_key_without_graphs_ignores_past_len():
    assert bucket_key((0, 2), feeds(4, [3, 9]), np.array([3, 9]), False) == \
        bucket_key((0, 2), feeds(4, [30, 1]), np.array([30, 1]), False)
    assert bucket_key((0, 1), feeds(4, [3]), np.array([3]), False) != \
        bucket_key((1, 2), feeds(4, [3]), np.array([3]), False)  # other slots: other KV addresses


def test_ort_key_with_graphs_holds_the_attended_length():
    def key(past, t=4):
        return bucket_key((0, len(past)), feeds(t, past), np.asarray(past, np.int64), True)

    assert key([5, 9]) == key([9, 5])  # same max and min of past_len: same shapes inside, rows are data
    assert key([5, 9]) != key([5, 10])  # another attended length L = max(past_len) + T
    assert key([5, 9]) != key([2, 9])  # another shortest prefix: the columns split elsewhere
    assert key([9]) != key([9], t=5)
    assert key([9]) != bucket_key((0, 1), feeds(4, [9]), np.array([9]), False)


# ── the exported graph: which shapes past_len's values reach ─────────────────────────────────────
SHAPE_INPUTS = {"Range": (0, 1, 2), "Slice": (1, 2, 3, 4), "Expand": (1,), "Reshape": (1,), "Tile": (1,),
                "TopK": (1,), "ConstantOfShape": (0,), "Pad": (1,), "Unsqueeze": (1,), "Squeeze": (1,),
                "Split": (1,), "ReduceSum": (1,), "ReduceMax": (1,), "ReduceMean": (1,), "ReduceMin": (1,), "OneHot": (1,),
                "Resize": (1, 2, 3), "NonZero": (0,), "Compress": (0, 1), "Unique": (0,)}
EACH, LONGEST, SHORTEST = "past_len", "max(past_len)", "min(past_len)"
WHOLE_BATCH = {"ReduceMax": LONGEST, "ReduceMin": SHORTEST}  # reductions of past_len over the batch


def shape_dependence(nodes, value: dict[str, set], functions: dict, opaque: frozenset = frozenset()) -> dict:
    """Follow past_len through `nodes`: {tensor: (what its values depend on, what its shape depends on)}.

    A tensor's shape depends on its inputs' shapes and on the values of the inputs an op reads as a
    shape (SHAPE_INPUTS); `Shape` turns a shape dependence into a value one; ReduceMax / ReduceMin
    of past_len itself is max(past_len) / min(past_len). A function call is followed into its body, unless its op is `opaque`
    (a TensorRT plugin: output shaped like its first input)."""
    shape: dict[str, set] = {}
    for n in nodes:
        assert not any(a.type in (a.GRAPH, a.GRAPHS) for a in n.attribute), f"{n.op_type}: subgraphs not followed"
        ins = [i for i in n.input if i]
        v_in = set().union(*(value.get(i, set()) for i in ins))
        s_in = set().union(*(shape.get(i, set()) for i in ins))
        if n.op_type in functions and n.op_type not in opaque:
            f = functions[n.op_type]
            inner = shape_dependence(f.node, {p: value.get(a, set()) for p, a in zip(f.input, n.input, strict=False)},
                                     functions, opaque)
            for out, res in zip(n.output, f.output, strict=True):
                value[out], shape[out] = inner[res][0] | s_in, inner[res][1] | s_in
            continue
        if n.op_type in opaque:
            outs = (v_in | s_in, set(shape.get(n.input[0], set())))
        elif n.op_type == "Shape":
            outs = (set(shape.get(n.input[0], set())), set())
        elif n.op_type in WHOLE_BATCH and value.get(n.input[0]) == {EACH} and len(ins) == 1:
            outs = ({WHOLE_BATCH[n.op_type]}, set(shape.get(n.input[0], set())))
        else:
            read_as_shape = set().union(*(value.get(n.input[i], set()) for i in SHAPE_INPUTS.get(n.op_type, ())
                                          if i < len(n.input) and n.input[i]))
            outs = (v_in | s_in, s_in | read_as_shape)
        for out in n.output:
            value[out], shape[out] = outs
    return {t: (value.get(t, set()), s) for t, s in shape.items()}


def test_the_analysis_tells_one_rows_past_len_from_the_longest():
    nodes = [onnx.helper.make_node("Gather", ["past_len", "zero"], ["p0"]),
             onnx.helper.make_node("Range", ["zero", "p0", "one"], ["by_row"]),
             onnx.helper.make_node("ReduceMax", ["past_len"], ["m"], keepdims=0),
             onnx.helper.make_node("Range", ["zero", "m", "one"], ["by_max"]),
             onnx.helper.make_node("Add", ["by_max", "past_len"], ["data"]),
             onnx.helper.make_node("Shape", ["data"], ["data_shape"])]
    deps = shape_dependence(nodes, {"past_len": {EACH}}, {})
    assert deps["by_row"][1] == {EACH} and deps["by_max"][1] == {LONGEST}
    assert deps["data"] == ({EACH, LONGEST}, {LONGEST}) and deps["data_shape"] == ({LONGEST}, set())


@pytest.fixture(scope="module")
def decoder() -> onnx.ModelProto:
    from specrt.export.decoder_graph import build_decoder_graph
    from specrt.export.loading import module_from_hf
    from tests.helpers import tiny_hf_model

    return build_decoder_graph(module_from_hf(tiny_hf_model("llama")))


def test_ort_graph_shapes_depend_on_max_past_len_only(decoder):
    """Why `bucket_key` holds max and min of past_len: the function body's shapes follow them, never
    one row's."""
    deps = shape_dependence(decoder.graph.node, {"past_len": {EACH}}, {f.name: f for f in decoder.functions})
    shaped_by = set().union(*(s for _, s in deps.values()))
    assert EACH not in shaped_by, "a shape follows one sequence's past_len: key CUDA graphs on every past_len"
    assert LONGEST in shaped_by  # the attention's length L = max(past_len) + T (the analysis sees it)
    assert SHORTEST in shaped_by  # where its columns split into the shared prefix and the tail


def test_trt_graph_shapes_do_not_depend_on_past_len_with_the_plugin(decoder):
    """Why `graph_key` holds shapes only: with TreeAttention a plugin, past_len is data everywhere."""
    functions = {f.name: f for f in decoder.functions}
    assert ta.NAME in functions
    deps = shape_dependence(decoder.graph.node, {"past_len": {EACH}}, functions, opaque=frozenset({ta.NAME}))
    assert not set().union(*(s for _, s in deps.values())), "a TensorRT engine shape follows past_len"
    assert EACH in deps["logits"][0]  # past_len does reach the outputs, as data
