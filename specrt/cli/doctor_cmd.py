"""`specrt doctor`: what is installed and usable here."""

from __future__ import annotations

import importlib
import platform
import shutil
import subprocess

import click

from specrt.paths import default_bundle


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    return getattr(mod, "__version__", "installed")


def _gpu() -> str:
    if not shutil.which("nvidia-smi"):
        return "none (nvidia-smi not found)"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "none"
    except Exception as e:
        return f"unknown ({e})"


SIMD_SHOWN = (("AVX2", "avx2"), ("AVX-512F", "avx512f"), ("AVX-512 VNNI", "avx512_vnni"),
              ("AVX-512 BF16", "avx512_bf16"), ("AVX-VNNI", "avx_vnni"), ("AMX", "amx_tile"))


def _simd() -> str:
    from specrt.runtime.machine import simd_features

    have = set(simd_features())
    return " ".join(f"{label}:{'yes' if flag in have else 'no'}" for label, flag in SIMD_SHOWN)


def _native() -> str:
    """The native backend's kernels here, or why it has none."""
    from specrt.engines.native import library
    from specrt.errors import SpecrtError

    try:
        return f"kernels {', '.join(library.available())}; auto runs {library.kernel()[0]} ({library.build()})"
    except SpecrtError as err:
        return f"unavailable ({err})"


def _bundle_exactness(bundle, threads: int) -> str:
    """The default bundle's backend under auto, its batch invariance on this machine and the mode in use."""
    from specrt.engines.registry import resolve_backend
    from specrt.errors import SpecrtError
    from specrt.runtime.exactness import describe_measured, resolve
    from specrt.schema.manifest import Manifest

    try:
        manifest = Manifest.load(bundle)
        backend, _ = resolve_backend("auto", bundle, manifest)
        e = resolve(bundle, manifest, threads, backend)
    except SpecrtError as err:
        return f"unknown ({err})"
    modes = describe_measured(e.record["measured"])
    verdict = f"mode in use: {e.mode.name} (exact)" if e.lossless else f"NOT exact: {e.reason}"
    return f"backend {backend}: verify vs plain max |Δlogits| {modes} ({e.source}); {verdict}"


@click.command("doctor")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="Threads to report the default bundle's batch invariance for (the runtime's --threads).")
def command(threads):
    """Report the CPU's SIMD features, onnxruntime providers, TensorRT, CUDA, GPU, and the default
    bundle's batch invariance measured on this machine with the execution mode in use."""
    import os

    import onnxruntime as ort

    from specrt.runtime.machine import cpu_model

    rows = [("python", platform.python_version()),
            ("cpu", f"{cpu_model()}, {os.cpu_count()} logical cores"),
            ("simd", _simd()),
            ("threads", f"{threads} (ONNX Runtime intra-op)"),
            ("onnxruntime", f"{ort.__version__} providers={','.join(ort.get_available_providers())}"),
            ("onnx", _version("onnx") or "missing")]
    trt = _version("tensorrt")
    rows.append(("tensorrt", trt or "not installed (pip install tensorrt from NVIDIA's index; needs a CUDA GPU)"))
    rows.append(("polygraphy", _version("polygraphy") or "not installed (pip install polygraphy)"))
    torch_v = _version("torch")
    if torch_v:
        import torch

        torch_v += f" (cuda available: {torch.cuda.is_available()})"
    rows.append(("torch (export only)", torch_v or "not installed (pip install 'specrt[export]')"))
    rows.append(("transformers (export only)", _version("transformers") or "not installed"))
    rows.append(("triton", _version("triton") or "not installed"))
    rows.append(("gpu", _gpu()))
    rows.append(("native backend", _native()))
    b = default_bundle()
    present = (b / "manifest.json").is_file()
    rows.append(("default bundle", f"{b} ({'present' if present else 'missing: run make export'})"))
    if present:
        rows.append(("exactness", _bundle_exactness(b, threads)))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
