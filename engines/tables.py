"""A graph's initializer read where it lies: the external-data file mapped read-only (no copy), so every
drafter layer of a process gathers its embedding rows from the one table the target graph stores. That
table is float32, or int8 blocks (a GGUF's Q8_0 / Q5_0 / Q6_K codes, carried by export/quantize.py as a
GatherBlockQuantized): `EmbeddingTable` gives the same float rows from either.

Checked before it is mapped: the data file is named inside the graph's own folder (no absolute path, no ".."),
and holds the bytes the tensor's shape and type need; anything else names the file and says to export the
bundle again. Links are followed: a linked or hard-linked copy of a bundle reads as the bundle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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


@dataclass(frozen=True)
class EmbeddingTable:
    """An embedding table [V, H]: float32 rows (`dense`), or int8 blocks (`codes` q + 128 [V, H] uint8, a float32
    scale per `block` inputs [V, H / block]) whose rows are dequantized on lookup, exactly: (q - 128)·d is the
    float a dense table of the same blocks holds. Either may be a read-only map of the graph's data file."""

    dense: np.ndarray | None = None
    codes: np.ndarray | None = None
    scales: np.ndarray | None = None
    block: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple((self.dense if self.dense is not None else self.codes).shape)

    def __getitem__(self, ids) -> np.ndarray:
        """Rows `ids` (an index array of any shape) as float32 [..., H]."""
        if self.dense is not None:
            return np.asarray(self.dense[ids], np.float32)
        ids = np.asarray(ids)
        q = self.codes[ids].astype(np.float32) - np.float32(128)
        d = self.scales[ids]
        return (q.reshape(*d.shape, self.block) * d[..., None]).reshape(*ids.shape, -1)


def embedding_table(path: Path, model: onnx.ModelProto | None = None) -> EmbeddingTable:
    """The target table of the ONNX graph at `path` (`model`: that graph, loaded without its data, if the caller
    has it): its float initializer, or the blocks a GatherBlockQuantized reads (codes and scales mapped, not
    copied; mapped anew each call, so a bundle exported again in place is read as it is now)."""
    path = Path(path)
    if not path.is_file():
        raise SpecrtError(f"ONNX graph {path} is missing: export the bundle again")
    model = model if model is not None else onnx.load(str(path), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    if TARGET_EMBEDDING in inits:
        return EmbeddingTable(dense=_read_only(tensor_array(path, inits[TARGET_EMBEDDING])))
    nodes = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    if len(nodes) != 1 or nodes[0].input[0] not in inits or nodes[0].input[2] not in inits:
        raise SpecrtError(f"{path} has no embedding table {TARGET_EMBEDDING!r}: export the bundle again")
    node = nodes[0]  # export/quantize.py table_nodes: codes [V, blocks, block] (maybe a tied head's), scales [V, blocks, 1]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    codes, scales = tensor_array(path, inits[node.input[0]]), tensor_array(path, inits[node.input[2]])
    block = int(attrs.get("block_size", 0))
    if (attrs.get("bits") != 8 or attrs.get("quantize_axis") != 2 or codes.ndim != 3 or block not in (16, 32)
            or codes.shape[2] != block or scales.shape != (*codes.shape[:2], 1) or codes.dtype != np.uint8
            or scales.dtype != np.float32):
        raise SpecrtError(f"{path}: the embedding blocks are {attrs.get('bits')}-bit, {codes.dtype} {codes.shape} in "
                          f"blocks of {block} with {scales.dtype} scales {scales.shape}; specrt reads 8-bit blocks of "
                          "16 or 32 with a float scale each: export the bundle again")
    codes, scales = codes.reshape(codes.shape[0], -1), scales.reshape(scales.shape[0], -1)  # views of the map
    return EmbeddingTable(codes=_read_only(codes), scales=_read_only(scales), block=block)


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr
