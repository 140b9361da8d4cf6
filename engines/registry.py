"""The decoder backends by name: one registry, one `make_decoder`.

    ort         ONNX Runtime on the CPU, numpy KV buffers bound in place (the default; always tested)
    ort-device  ONNX Runtime's device path (device KV, per-shape buffers, on-device compaction) run on
                the CPU provider: what the CUDA path does, checkable on any machine
    ort-cuda    ONNX Runtime's CUDA provider (`pip install onnxruntime-gpu`), CUDA graphs per bucket
    trt         TensorRT engines built by `specrt build --backend trt`; needs `engine_path` and
                `max_window` (see `trt_options`), batch 1, KV capacity as built
    native      specrt's own CPU kernels (engines/native/): W4A8 products and attention whose rows do not depend
                on how many rows share the pass; int4 Llama-family bundles; compiled on first use
    ort-fused   ONNX Runtime on the CPU, each layer's attention one GroupQueryAttention node
                (engines/ort_cpu/fuse.py, written by `specrt build`): faster, verifies chains only; batches
                sequences one row each (a window of several rows runs at batch 1)

Every factory takes (path, cfg, capacity, threads, batch, spin) plus its own keyword options.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specrt.engines.decoder import Decoder
from specrt.errors import SpecrtError
from specrt.schema.config import DecoderConfig


def _ort(path: Path, cfg: DecoderConfig, capacity: int, threads: int, batch: int, spin: bool) -> Decoder:
    from specrt.engines.ort_cpu.runner import OrtDecoder

    return OrtDecoder(path, cfg, capacity, threads, batch, spin)


def _ort_device(path: Path, cfg: DecoderConfig, capacity: int, threads: int, batch: int, spin: bool) -> Decoder:
    from specrt.engines.ort_device.runner import OrtDeviceDecoder

    return OrtDeviceDecoder(path, cfg, capacity, threads, batch, spin, device="cpu", cuda_graphs=False)


def _ort_cuda(path: Path, cfg: DecoderConfig, capacity: int, threads: int, batch: int, spin: bool,
              cuda_graphs: bool = True) -> Decoder:
    from specrt.engines.ort_device.runner import OrtDeviceDecoder

    return OrtDeviceDecoder(path, cfg, capacity, threads, batch, spin, device="cuda", cuda_graphs=cuda_graphs)


def _trt(path: Path, cfg: DecoderConfig, capacity: int, threads: int, batch: int, spin: bool,
         engine_path: Path | None = None, max_window: int | None = None, cuda_graphs: bool = True) -> Decoder:
    """`path` (the ONNX graph) is not read: a TensorRT engine is its own file, named in the manifest."""
    from specrt.engines.trt.runner import TrtDecoder

    if engine_path is None or max_window is None:
        raise SpecrtError("backend trt needs engine_path and max_window: get them with "
                          "specrt.engines.registry.trt_options(bundle, manifest, role, capacity)")
    if batch != 1:
        raise SpecrtError(f"backend trt runs batch 1, got batch {batch}: use backend ort or ort-cuda")
    return TrtDecoder(engine_path, cfg, capacity, max_window, cuda_graphs=cuda_graphs)


def _native(path: Path, cfg: DecoderConfig, capacity: int, threads: int, batch: int, spin: bool,
            kernel: str = "auto", kv_dtype: str = "fp16") -> Decoder:
    from specrt.engines.native.runner import NativeDecoder

    return NativeDecoder(path, cfg, capacity, threads, batch, spin, kernel=kernel, kv_dtype=kv_dtype)


@dataclass(frozen=True)
class Backend:
    factory: Callable[..., Decoder]
    summary: str  # one line for --help
    bundle_options: Callable[..., dict] | None = None  # (bundle, manifest, role, capacity) -> options
    max_batch: int = 64  # KV slots one decoder can hold
    pinned_capacity: bool = False  # True: built for one KV capacity (TensorRT engines)
    graph_file: Callable[..., Path] | None = None  # (bundle, manifest, role) -> the ONNX file it runs
    trees: bool = True  # False: tree rows are not bitwise those of chains (runtime verifies chains only)
    # False: a pass over several sequences takes one new row per sequence (plain decoding of each); a
    # window of several rows (a draft, a prompt chunk) runs at batch 1 (the serving scheduler plans so)
    batch_windows: bool = True
    # (bundle, manifest, role) -> the ONNX file a decoder of several sequences runs, where it is another one
    # than `graph_file` (ort-fused: its batch-1 graph pads GroupQueryAttention with a row, which batches refuse)
    batched_graph_file: Callable[..., Path] | None = None
    # the dtypes its KV cache can hold besides fp32 (a `kv_dtype` option where any); --kv-dtype auto picks fp16
    # where it is one
    kv_dtypes: tuple[str, ...] = ()
    # its KV cache is numpy arrays in host memory, [batch, kv_heads, capacity, head_dim] per buffer (`kv`), whose
    # rows the serving prefix cache copies (serving/prefix_cache.py)
    host_kv: bool = False


BACKENDS: dict[str, Backend] = {
    "ort": Backend(_ort, "ONNX Runtime on the CPU (default)", host_kv=True),
    "native": Backend(_native, "specrt's own batch-invariant int4 kernels on the CPU (int4 Llama-family bundles; "
                      "compiled on first use)", graph_file=lambda bundle, manifest, role: Path(bundle) / manifest.graphs[role].file,
                      kv_dtypes=("fp16", "int8"), host_kv=True),
    "ort-device": Backend(_ort_device, "ONNX Runtime's device path on the CPU provider (for tests)"),
    "ort-cuda": Backend(_ort_cuda, "ONNX Runtime's CUDA provider with CUDA graphs (onnxruntime-gpu)"),
    "trt": Backend(_trt, "TensorRT engines from `specrt build --backend trt` (batch 1)",
                   lambda *a: trt_options(*a), max_batch=1, pinned_capacity=True),
    # GroupQueryAttention takes several new rows after a cached prefix only at batch 1, and one row per
    # sequence at any batch
    "ort-fused": Backend(_ort, "ONNX Runtime on the CPU, attention fused (GroupQueryAttention): chains only; "
                         "batches one row per sequence", graph_file=lambda *a: fused_graph(*a), trees=False,
                         batch_windows=False, batched_graph_file=lambda *a: fused_graph(*a, batched=True)),
}
BASE_ARGS = ("path", "cfg", "capacity", "threads", "batch", "spin")


AUTO = "auto"  # the backend a caller gets when it names none: `resolve_backend`


def native_unavailable(bundle: Path, manifest) -> str:
    """Why the native backend cannot run this bundle's target here, as a phrase; "" when it can."""
    from specrt.engines.native import library
    from specrt.engines.native.weights import unsupported

    quant = manifest.artifacts.get("quantization", {})
    if quant.get("scheme") != "int4" or not quant.get("matmuls", {}).get("target"):
        return "the bundle is not int4 (`specrt export --quantize int4`)"
    why = unsupported(manifest.target.config)
    if why:
        return f"it does not compute {why}"
    try:
        kernels = library.available()
    except SpecrtError as e:
        return str(e).split(";")[0]
    if kernels[-1] == "scalar":
        return "this CPU has no AVX2 (its scalar kernel is a reference, slower than ort)"
    return ""


def resolve_backend(requested: str, bundle: Path, manifest) -> tuple[str, str]:
    """(the backend to run, a one-line note or ""): `requested` unless it is auto; auto is the fastest exact
    backend for the bundle here: `native` for an int4 bundle it computes on a CPU with AVX2, else `ort`. The
    note says why auto passed native over where the bundle is int4."""
    if requested != AUTO:
        backend_entry(requested)
        return requested, ""
    why = native_unavailable(Path(bundle), manifest)
    if not why:
        return "native", ""
    int4 = manifest.artifacts.get("quantization", {}).get("scheme") == "int4"
    return "ort", (f"note: --backend auto runs ort: the native backend cannot run here ({why})" if int4 else "")


def backend_entry(name: str) -> Backend:
    if name not in BACKENDS:
        raise SpecrtError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


def make_decoder(backend: str, path: Path, cfg: DecoderConfig, capacity: int, threads: int = 2,
                 batch: int = 1, spin: bool = True, **options) -> Decoder:
    """A decoder for the graph at `path` on backend `backend` (a key of BACKENDS)."""
    entry = backend_entry(backend)
    known = [p for p in inspect.signature(entry.factory).parameters if p not in BASE_ARGS]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise SpecrtError(f"backend {backend} takes no option {', '.join(unknown)} "
                          f"(its options: {', '.join(known) or 'none'})")
    return entry.factory(Path(path), cfg, int(capacity), threads, batch, spin, **options)


def trt_options(bundle: Path, manifest, role: str, capacity: int) -> dict:
    """`engine_path` and `max_window` of `role`'s TensorRT engine, from the bundle's manifest.

    The engines pin the KV capacity they were built for, so `capacity` must equal it."""
    built = manifest.artifacts.get("tensorrt")
    if not built or role not in built.get("graphs", {}):
        raise SpecrtError(f"bundle {bundle} has no TensorRT engine for {role}: run `specrt build {bundle} "
                          "--backend trt` on a machine with TensorRT")
    if int(built["capacity"]) != int(capacity):
        raise SpecrtError(f"the TensorRT engines of {bundle} were built for KV capacity {built['capacity']}, not "
                          f"{capacity}: use --max-seq-len {built['capacity']} or rebuild with "
                          f"`specrt build --backend trt --max-seq-len {capacity}`")
    return {"engine_path": Path(bundle) / built["graphs"][role]["file"], "max_window": int(built["max_window"])}


def fused_graph(bundle: Path, manifest, role: str, batched: bool = False) -> Path:
    """The `ort-fused` graph of `role` that `specrt build` wrote (engines/ort_cpu/fuse.py); `batched`: the
    one for several sequences per pass."""
    built = manifest.artifacts.get("onnxruntime", {}).get("fused_batched" if batched else "fused", {}).get(role)
    if not built or not (Path(bundle) / built["file"]).is_file():
        from specrt.engines.ort_cpu.fuse import not_lowered

        why = not_lowered(manifest.graphs[role].config)
        if why:
            raise SpecrtError(f"bundle {bundle} has no fused graph for {role}: ort-fused does not lower {why}; "
                              "use --backend ort (exact, unfused)")
        raise SpecrtError(f"bundle {bundle} has no fused graph for {role}: run `specrt build {bundle}` (it "
                          "writes one for each decoder graph it can lower), or use --backend ort")
    return Path(bundle) / built["file"]


def graph_path(backend: str, bundle: Path, manifest, role: str, batched: bool = False) -> Path:
    """The ONNX file `backend` runs for graph `role` of a bundle (`batched`: in a decoder of several
    sequences)."""
    entry = backend_entry(backend)
    if batched and entry.batched_graph_file:
        return entry.batched_graph_file(bundle, manifest, role)
    return entry.graph_file(bundle, manifest, role) if entry.graph_file else manifest.onnx_path(bundle, role)


def open_decoder(backend: str, bundle: Path, manifest, role: str, capacity: int, threads: int = 2,
                 batch: int = 1, **given) -> Decoder:
    """The decoder for graph `role` of a bundle on `backend`, with the options the bundle records for it and
    the backend options `given` (make_decoder refuses one the backend does not take)."""
    entry = backend_entry(backend)
    options = entry.bundle_options(bundle, manifest, role, capacity) if entry.bundle_options else {}
    options.update(given)
    return make_decoder(backend, graph_path(backend, bundle, manifest, role, batch > 1), manifest.graphs[role].config,
                        capacity, threads, batch, **options)
