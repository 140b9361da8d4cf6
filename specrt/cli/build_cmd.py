"""`specrt build`: backend artifacts from a bundle's ONNX graphs (ONNX Runtime; TensorRT where installed)."""

from __future__ import annotations

import click

from specrt.cli.options import bundle_argument, echo_exactness, resolve_bundle


@click.command("build")
@bundle_argument
@click.option("--backend", type=click.Choice(["auto", "ort", "trt"]), default="auto", show_default=True,
              help="auto: ONNX Runtime artifacts (and the native kernels, compiled and measured, for an int4 "
                   "bundle they run), plus TensorRT engines when TensorRT is installed.")
@click.option("--precision", type=click.Choice(["fp16", "bf16", "fp32"]), default="fp16", show_default=True,
              help="TensorRT precision.")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="TensorRT: the KV capacity the engines pin (generate with the same --max-seq-len). "
                   "Default: min(2048, model maximum), the runtime's default.")
@click.option("--max-window", type=click.IntRange(min=1), default=None,
              help="TensorRT: the largest window per pass (drafted tree + root; longer prefills run in chunks). "
                   "Default: 64.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="ONNX Runtime threads the artifacts are built and their batch invariance measured with "
                   "(run with the same --threads to use this measurement).")
def command(bundle, backend, precision, max_seq_len, max_window, threads):
    """Build engines for BUNDLE and record them in its manifest, with the batch invariance of the
    target measured on this machine (the execution mode the runtime then uses here)."""
    from specrt.engines.ort_cpu.build import build_ort
    from specrt.engines.registry import resolve_backend
    from specrt.engines.trt.build import INSTALL_HINT, build_trt, tensorrt_available
    from specrt.runtime.exactness import measured_here, store_in_manifest
    from specrt.schema.manifest import Manifest

    path = resolve_bundle(bundle)
    manifest = Manifest.load(path)
    if backend in ("auto", "ort"):
        manifest.artifacts["onnxruntime"] = build_ort(path, manifest, threads)
        for role, g in manifest.artifacts["onnxruntime"]["graphs"].items():
            click.echo(f"onnxruntime: {role} -> {g['file']} ({g['seconds']}s)")
        record = measured_here(path, manifest, threads, "ort")
        store_in_manifest(manifest, record)
        manifest.save(path)
        echo_exactness(record)
        native, why = resolve_backend("auto", path, manifest)
        if native == "native":  # the runtime's default backend here: compiled and measured now, not at first use
            record = measured_here(path, manifest, threads, "native")
            store_in_manifest(manifest, record)
            manifest.save(path)
            echo_exactness(record)
        elif why:
            click.echo(why)
    if backend == "trt" or (backend == "auto" and tensorrt_available()):
        manifest.artifacts["tensorrt"] = build_trt(path, manifest, precision, capacity=max_seq_len,
                                                   max_window=max_window)
        manifest.save(path)
    elif backend == "auto":
        click.echo(f"note: {INSTALL_HINT}.\nnote: built the ONNX Runtime artifacts only.")
