"""The torch code paths training and distillation run, chosen from the CPU unless forced
(runtime/branches.py): bf16 autocast in `specrt train`, the int8 engine of `specrt distill --precision
int8`, and ATen's SIMD dispatch under both (torch's own `ATEN_CPU_CAPABILITY`, read when torch loads).

Training computes in bf16 (autocast: fp32 weights and optimizer) where the CPU has native bf16
arithmetic (AVX-512 BF16, AMX, Arm BF16), else in fp32: on an AVX2-only CPU bf16 matmuls are emulated
and ~50x slower. Forced bf16 runs everywhere, slowly where emulated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from specrt.errors import SpecrtError
from specrt.runtime.branches import Choice, pick, record

AUTOCAST = {"bf16": torch.bfloat16, "fp32": None}  # train_precision value -> autocast dtype (None: off)
METRICS_NAME = {"bf16": "bf16-autocast", "fp32": "fp32"}  # metrics.json "precision"
NATIVE_BF16 = ("avx512_bf16", "amx_bf16", "bf16")  # /proc/cpuinfo flags of native bf16 arithmetic


def native_bf16() -> list[str]:
    """This CPU's features that compute bf16 natively (empty: bf16 is emulated here)."""
    from specrt.runtime.machine import simd_features

    return [f for f in simd_features() if f in NATIVE_BF16]


def train_precision(requested: str = "auto") -> tuple[str, dict]:
    """("bf16" or "fp32", the record metrics.json keeps): `requested`, else SPECRT_TRAIN_PRECISION, else
    bf16 where the CPU has it natively."""
    choice = pick("train_precision", requested)
    if choice.forced:
        return choice.value, record(choice, choice.value)
    have = native_bf16()
    value = "bf16" if have else "fp32"
    return value, record(choice, value, f"native bf16 ({', '.join(have)})" if have else "no native bf16")


def autocast(value: str) -> contextlib.AbstractContextManager:
    """The autocast context of a train_precision value (bf16: CPU autocast; fp32: nothing)."""
    dtype = AUTOCAST[value]
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def quant_engine(requested: str = "auto") -> tuple[str, dict]:
    """The torch int8 engine to quantize and run with, and its record: `requested`, else
    SPECRT_QUANT_ENGINE, else torch's current engine. An engine this torch build lacks is refused."""
    choice: Choice = pick("quant_engine", requested)
    current = torch.backends.quantized.engine
    if not choice.forced:
        return current, record(choice, current, "torch's engine for this CPU")
    supported = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if choice.value not in supported:
        where = "--quant-engine" if choice.forced_by == "option" else choice.forced_by
        raise SpecrtError(f"{where} {choice.value}: this torch build has only {', '.join(supported)}")
    return choice.value, record(choice, choice.value)


@contextlib.contextmanager
def engine_in_use(engine: str) -> Iterator[None]:
    """torch's int8 engine set to `engine` (packing and running dynamic int8 linears), restored after."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def aten_dispatch() -> dict:
    """ATen's SIMD kernel level (torch picks it from the CPU; ATEN_CPU_CAPABILITY forces it)."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "")
    return {"value": torch.backends.cpu.get_cpu_capability(), "forced": bool(forced),
            "chosen_by": "ATEN_CPU_CAPABILITY" if forced else "auto: torch's CPU dispatch"}
