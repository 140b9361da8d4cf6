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


@click.command("doctor")
def command():
    """Report onnxruntime providers, TensorRT, CUDA, GPU and the default bundle."""
    import onnxruntime as ort

    rows = [("python", platform.python_version()),
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
    b = default_bundle()
    rows.append(("default bundle", f"{b} ({'present' if (b / 'manifest.json').is_file() else 'missing: run make export'})"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{width}}  {v}")
