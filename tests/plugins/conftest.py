"""Triton's CPU interpreter for the kernel tests (tests/plugins/test_triton_kernels.py).

`triton.jit` picks the interpreter when a kernel module is imported, so the variable must be set
before any test imports specrt.plugins.triton_kernels.*; pytest loads this file before collecting the
folder's test modules, whatever was collected (or imported triton) earlier.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
