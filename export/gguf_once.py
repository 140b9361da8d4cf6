"""Read a GGUF file's header once per model load.

transformers reads a .gguf's metadata for each of config, tokenizer, generation config and weights: four
`gguf.GGUFReader` parses of every field (a 49k-token vocabulary and its merges are ~10^6 small numpy views,
~3 s a parse on a 2-core VM), four conversions of them into Python values, and a `gguf.TensorNameMap` for
each of the model's ~400 submodules. Each is a pure function of its arguments and none is changed after it
is built, so within `gguf_parsed_once()` each is built once: the reader and the name maps shared, the
metadata (`load_gguf_checkpoint(path)` without tensors) handed out as a fresh copy each time, since
transformers edits the dicts it gets. transformers imports these names inside its functions, so swapping the
modules' attributes for the span of the load is what it sees; they are restored on exit. The model loaded is
the same, value for value (tests/export/test_gguf_once.py). An export holds it around its load, its check of
the file's types and its read of the file's blocks (export/gguf_blocks.py), so all of them share one parse;
inside it, a nested `gguf_parsed_once()` changes nothing.

The one reader also parses faster: it slices its file as a plain ndarray over the same mapping, not through
`np.memmap`, whose Python-level `__getitem__` and `__array_finalize__` run for each of those views (2.7 s
against 1.0 s a parse on the 2-core AVX2 VM, the same fields and tensors; the tensors' data are then ndarrays
over the mapping rather than memmaps).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import threading
from collections.abc import Iterator

import numpy as np

_lock = threading.Lock()  # one load swaps the attributes at a time
_held = threading.local()  # this thread is inside gguf_parsed_once (an export around its load): nested, a no-op


def _plain_views(reader: type) -> type:
    """`reader` (gguf.GGUFReader or a subclass) whose `data` is its memmap viewed as a plain ndarray."""

    class PlainViews(reader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped):
            self._mapped, self._plain = mapped, mapped.view(np.ndarray)

    return PlainViews


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    try:
        import gguf
        from transformers import modeling_gguf_pytorch_utils as hf_gguf
    except ImportError:  # transformers then reports the missing package itself
        yield
        return
    if getattr(_held, "active", False):
        yield
        return
    with _lock:
        _held.active = True
        reader, name_map, checkpoint = gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint
        readers: dict[tuple, object] = {}
        metadata: dict[tuple, dict] = {}

        def key_of(path, *rest) -> tuple:
            st = os.stat(path)
            return (os.path.realpath(path), *rest, st.st_size, st.st_mtime_ns)

        def one_reader(path, mode="r"):
            key = key_of(path, mode)
            if key not in readers:
                readers[key] = _plain_views(reader)(path, mode)
            return readers[key]

        def one_checkpoint(path, *args, **kwargs):
            if args or any(kwargs.values()):  # the weights (return_tensors=True, a model to load): every time
                return checkpoint(path, *args, **kwargs)
            key = key_of(path)
            if key not in metadata:
                metadata[key] = checkpoint(path)
            return copy.deepcopy(metadata[key])

        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = one_reader, functools.cache(name_map), one_checkpoint
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, name_map, checkpoint
            _held.active = False
