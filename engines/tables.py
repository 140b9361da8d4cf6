"""A graph's initializer read where it lies: the external-data file mapped read-only (no copy), so every
drafter layer of a process gathers its embedding rows from the one table the target graph stores.

Checked before it is mapped: the data file is named inside the graph's own folder (no absolute path, no ".."),
and holds the bytes the tensor's shape and type need; anything else names the file and says to export the
bundle again. Links are followed: a linked or hard-linked copy of a bundle reads as the bundle.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specrt.errors import SpecrtError

TARGET_EMBEDDING = "model.embed_tokens.weight"  # export/decoder_graph.py's name for the target's table


def _external(path: Path, tensor: onnx.TensorProto) -> np.ndarray:
    info = {e.key: e.value for e in tensor.external_data}
    location = Path(info.get("location", ""))
    data = path.parent / location  # a link the user made (a linked copy of a bundle) is followed
    if location.is_absolute() or ".." in location.parts or not data.is_file():
        raise SpecrtError(f"{path}: {tensor.name}'s data {info.get('location')!r} is not a file beside the graph: "
                          "export the bundle again")
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type))
    shape = tuple(int(d) for d in tensor.dims)
    offset, need = int(info.get("offset", 0)), int(np.prod(shape)) * dtype.itemsize
    if int(info.get("length", need)) != need or data.stat().st_size < offset + need:
        raise SpecrtError(f"{data}: {tensor.name} needs {need} bytes at offset {offset} and the file is "
                          f"{data.stat().st_size} bytes: export the bundle again")
    return np.memmap(data, dtype, "r", offset, shape)


def tensor_array(path: Path, tensor: onnx.TensorProto) -> np.ndarray:
    """Initializer `tensor` of the graph at `path` as an array: mapped read-only from its data file when
    external (checked as above, so a bundle copied with hard links reads as any other), else decoded."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return _external(Path(path), tensor)
    return numpy_helper.to_array(tensor)


@functools.cache
def initializer(path: Path, name: str) -> np.ndarray:
    """Initializer `name` of the ONNX graph at `path`, read-only (mapped from its data file when external)."""
    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
    model = onnx.load(str(path), load_external_data=False)
    for t in model.graph.initializer:
        if t.name == name:
            arr = tensor_array(path, t)
            arr.flags.writeable = False  # a memmap is read-only already; an inline array is made so
            return arr
    raise SpecrtError(f"{path} has no initializer {name!r}: export the bundle again")
