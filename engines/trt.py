"""TensorRT engines (GPU path). Every import is gated: without TensorRT this says what to install."""

from __future__ import annotations

from specrt.errors import SpecrtError

INSTALL_HINT = ("TensorRT is not installed: on a machine with an NVIDIA GPU and CUDA, "
                "`pip install tensorrt polygraphy` (wheels come from NVIDIA's index via pypi.nvidia.com)")


def require_tensorrt():
    """Import tensorrt or raise one clear line saying what to install."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise SpecrtError(INSTALL_HINT) from None
    return tensorrt


def tensorrt_available() -> bool:
    try:
        require_tensorrt()
    except SpecrtError:
        return False
    return True


def build_trt(bundle, manifest, precision: str = "fp16"):
    require_tensorrt()
    raise SpecrtError("TensorRT engine building is not implemented in this version of specrt "
                      "(tracked as the GPU-path issue); use --backend ort")
