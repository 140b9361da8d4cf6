"""CMake flags that build llama.cpp (llama-cpp-python) for the CPU this runs on.

`-march=native` is avoided on x86: some VMs advertise AMX without enabling it and llama.cpp's AMX
path then faults, so the x86 features are pinned one by one from /proc/cpuinfo (AMX always off).
Standard library only: the Makefile runs it before any virtual environment exists.

    python scripts/llama_cmake_args.py            # flags for this CPU
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# GGML option -> the /proc/cpuinfo flag that enables it
GGML_X86 = (("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
            ("GGML_BMI2", "bmi2"), ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"),
            ("GGML_AVX512_VBMI", "avx512_vbmi"), ("GGML_AVX512_VNNI", "avx512_vnni"),
            ("GGML_AVX512_BF16", "avx512_bf16"))
AMX_OFF = ("-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")


def cmake_args(features: set[str]) -> list[str]:
    """The flags for a CPU with these features (x86: pinned, AMX off; elsewhere: native)."""
    if "avx" not in features and "sse4_2" not in features:
        return ["-DGGML_NATIVE=ON"]
    pinned = [f"-D{option}={'ON' if flag in features else 'OFF'}" for option, flag in GGML_X86]
    return ["-DGGML_NATIVE=OFF", *pinned, *AMX_OFF]


def _machine():
    path = Path(__file__).resolve().parents[1] / "runtime" / "machine.py"
    spec = importlib.util.spec_from_file_location("specrt_machine", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(" ".join(cmake_args(set(_machine().simd_features()))))
