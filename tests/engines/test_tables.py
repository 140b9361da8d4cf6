"""Initializers mapped from a graph's external data: the same values as onnx reads, no copy, and a data file
outside the graph's folder, or too short for the tensor, refused naming it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt.engines.tables import initializer
from specrt.errors import SpecrtError


def _graph(folder, table: np.ndarray):
    folder.mkdir(parents=True, exist_ok=True)
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, [None])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [None, table.shape[1]])
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["out"])], "g", [ids], [out],
                              [numpy_helper.from_array(table, "table"), numpy_helper.from_array(np.ones(3, np.float32), "b")])
    path = folder / "g.onnx"
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location="g.onnx.data", size_threshold=64)
    return path


def test_a_mapped_table_is_the_graphs_own(tmp_path):
    table = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    path = _graph(tmp_path / "a", table)
    got = initializer(path, "table")
    assert isinstance(got, np.memmap) and not got.flags.writeable
    np.testing.assert_array_equal(got, table)
    np.testing.assert_array_equal(initializer(path, "b"), np.ones(3, np.float32))  # small: stored inline
    with pytest.raises(SpecrtError, match="has no initializer 'nothing'"):
        initializer(path, "nothing")


def test_bad_external_data_is_refused_naming_the_file(tmp_path):
    table = np.zeros((50, 8), np.float32)
    path = _graph(tmp_path / "b", table)
    data = tmp_path / "b" / "g.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(SpecrtError, match=r"g\.onnx\.data: table needs 1600 bytes.*export the bundle again"):
        initializer(path, "table")
    model = onnx.load(str(_graph(tmp_path / "c", table)), load_external_data=False)
    for e in model.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "../b/g.onnx.data"
    onnx.save(model, tmp_path / "c" / "evil.onnx")
    with pytest.raises(SpecrtError, match="is not a file beside the graph"):
        initializer(tmp_path / "c" / "evil.onnx", "table")
