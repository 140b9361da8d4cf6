"""`make setup-peers` builds llama.cpp for the CPU it runs on: flags from the CPU's features."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llama_cmake_args.py"


def _module():
    spec = importlib.util.spec_from_file_location("llama_cmake_args", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_avx2_only_cpu_gets_no_avx512_and_never_amx():
    args = _module().cmake_args({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
    assert "-DGGML_NATIVE=OFF" in args and "-DGGML_AVX2=ON" in args and "-DGGML_BMI2=ON" in args
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX512_VNNI=OFF" in args
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)


def test_avx512_cpu_keeps_its_features_but_not_amx():
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_int8"}
    args = _module().cmake_args(flags)
    assert "-DGGML_AVX512=ON" in args and "-DGGML_AVX512_VNNI=ON" in args and "-DGGML_AVX512_BF16=ON" in args
    assert "-DGGML_AVX512_VBMI=OFF" in args and "-DGGML_AMX_INT8=OFF" in args


def test_non_x86_builds_native():
    assert _module().cmake_args({"asimd", "sve"}) == ["-DGGML_NATIVE=ON"]


def test_script_prints_flags_for_this_cpu_with_the_standard_library_only():
    out = subprocess.run([sys.executable, "-I", str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert out.startswith("-DGGML_NATIVE=")
    from specrt.runtime.machine import simd_features

    features = set(simd_features())
    assert ("-DGGML_AVX2=ON" in out) == ("avx2" in features)
    assert ("-DGGML_AVX512=ON" in out) == ("avx512f" in features)
