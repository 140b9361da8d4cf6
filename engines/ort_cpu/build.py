"""ONNX Runtime artifacts: each graph optimized once (graph fusions) and saved beside the original.

The saved graph uses only ONNX Runtime's portable (extended) optimizations, so it runs on any CPU
with the same ONNX Runtime version; hardware-specific layout passes still run at session start.
Decoder graphs also get their `--backend ort-fused` forms (`write_fused`): the batch-1 graph (its attention
padded with a row, engines/ort_cpu/fuse.py) and the graph for several sequences per pass (unpadded).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import onnx
import onnxruntime as ort

from specrt.engines.ort_cpu.fuse import PAD_ROWS, fuse_attention
from specrt.plugins.tree_attention import NAME
from specrt.schema.digests import file_digests
from specrt.schema.manifest import Manifest


def build_ort(bundle: Path, manifest: Manifest, threads: int = 2) -> dict:
    """Write `<graph>.ort-opt.onnx` (+ external weights) for every graph; returns the manifest entry."""
    entry = {"onnxruntime": ort.__version__, "graphs": {}}
    for role, graph in manifest.graphs.items():
        src = bundle / graph.file
        dst = src.with_name(src.stem + ".ort-opt.onnx")
        data = dst.name + ".data"
        t0 = time.perf_counter()
        # written under their final names in a scratch folder (the graph refers to its data file by
        # name), then moved into place: a failed build leaves nothing half-written
        with tempfile.TemporaryDirectory(dir=src.parent) as scratch:
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
            so.optimized_model_filepath = str(Path(scratch) / dst.name)
            so.log_severity_level = 3
            so.intra_op_num_threads = threads
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            ort.InferenceSession(str(src), so, providers=["CPUExecutionProvider"])
            (Path(scratch) / data).replace(dst.with_name(data))
            (Path(scratch) / dst.name).replace(dst)
        entry["graphs"][role] = {"file": str(dst.relative_to(bundle)), "seconds": round(time.perf_counter() - t0, 2),
                                 "sha256": file_digests(dst, dst.with_name(data))}  # verified at load
        for key, suffix, pad in FUSED:
            fused = write_fused(src, graph.config, suffix, pad)
            if fused is not None:
                entry.setdefault(key, {})[role] = {"file": str(fused.relative_to(bundle)),
                                                   "sha256": file_digests(fused)}
    return entry


# (manifest key under artifacts.onnxruntime, file suffix, attention pad rows): the batch-1 graph and the one
# for several sequences per pass (engines/registry.py fused_graph reads both keys)
FUSED = (("fused", ".ort-fused.onnx", PAD_ROWS), ("fused_batched", ".ort-fused-batched.onnx", 0))


def write_fused(src: Path, cfg, suffix: str = ".ort-fused.onnx", pad_rows: int = PAD_ROWS) -> Path | None:
    """`<graph><suffix>` beside a decoder graph, its attention lowered for `--backend ort-fused`
    (engines/ort_cpu/fuse.py) with `pad_rows`; it reads the graph's own external weights file. None: not
    lowerable."""
    model = onnx.load(str(src), load_external_data=False)
    if not any(n.op_type == NAME for n in model.graph.node):
        return None
    fused = fuse_attention(model, cfg, pad_rows)
    if fused is None:
        return None
    dst = src.with_name(src.stem + suffix)
    fd, tmp = tempfile.mkstemp(dir=src.parent, prefix=dst.name, suffix=".tmp")
    os.close(fd)
    onnx.save_model(fused, tmp)  # weights stay in the source's external data file
    os.replace(tmp, dst)
    return dst
