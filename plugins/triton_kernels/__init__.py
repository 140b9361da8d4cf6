"""Triton kernels for the custom ops `specrt::TreeAttention` and `specrt::RejectionSample`.

These are what a GPU backend (or a TensorRT plugin built from them ahead of time) calls in place of
the ONNX function bodies; they compute the same thing as the NumPy references beside the ops.

    from specrt.plugins.triton_kernels.tree_attention import tree_attention
    from specrt.plugins.triton_kernels.rejection_sample import rejection_sample

Each launcher takes torch tensors: CUDA tensors, or CPU tensors when TRITON_INTERPRET=1 was set
before the kernel modules were imported (Triton's CPU interpreter: slow, for tests). Importing this
package or its modules never needs triton; calling a launcher without it raises SpecrtError.
"""

from __future__ import annotations

from typing import Any

from specrt.errors import SpecrtError

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels are optional: the CPU runtime never needs them
    triton = tl = None

INSTALL_HINT = "pip install triton (needs a CUDA GPU, or TRITON_INTERPRET=1 for the CPU interpreter)"


def jit(fn):
    """`triton.jit` when triton is installed; the plain function otherwise (launchers then refuse)."""
    return triton.jit(fn) if triton is not None else fn


def check_launch(kernel: Any, *tensors) -> None:
    """Raise SpecrtError when `kernel` cannot run on `tensors` here (no triton, or CPU tensors
    without the interpreter, or tensors on different devices)."""
    if triton is None:
        raise SpecrtError(f"the Triton kernels need triton, which is not installed: {INSTALL_HINT}")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise SpecrtError(f"the Triton kernel's inputs are on several devices: {sorted(map(str, devices))}")
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if tensors[0].device.type == "cpu" and not interpreted:
        raise SpecrtError("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
                          "specrt.plugins.triton_kernels, or pass CUDA tensors")
