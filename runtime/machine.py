"""What the machine that runs a bundle is, as far as kernels care: CPU model, SIMD features, ONNX
Runtime version, threads. Whether a verify pass is batch-invariant depends on exactly these (an M=1
GEMV and an M≥2 GEMM are different code on some CPUs), so measurements are keyed by this fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

# The x86 flags (as /proc/cpuinfo spells them) that change which kernels ONNX Runtime and llama.cpp pick.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_vbmi", "amx_tile", "amx_int8", "amx_bf16")
ARM_FLAGS = ("asimd", "asimddp", "sve", "sve2", "i8mm", "bf16")


@cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; (platform.processor(), {}) where there is none."""
    path = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first processor's entry
    model = fields.get("model name") or fields.get("Model") or platform.processor() or platform.machine()
    flags = (fields.get("flags") or fields.get("Features") or "").split()
    return model, frozenset(flags)


def cpu_model() -> str:
    return _cpuinfo()[0]


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_note(threads: int, cpus: int) -> str:
    """A one-line warning when `threads` exceeds `cpus`, else "": kernels' threads that outnumber the CPUs wait on
    each other at every barrier, and a pass slows by orders of magnitude."""
    if threads <= cpus:
        return ""
    return (f"warning: --threads {threads} is more than the {cpus} CPUs this process may use: threads past the CPUs "
            f"wait on each other and every pass slows down; --threads {cpus} is the most that helps")


def simd_features() -> list[str]:
    """The kernel-relevant SIMD features this CPU reports, in a fixed order."""
    flags = _cpuinfo()[1]
    return [f for f in (*SIMD_FLAGS, *ARM_FLAGS) if f in flags]


@dataclass(frozen=True)
class Fingerprint:
    cpu: str
    features: tuple[str, ...]
    onnxruntime: str
    threads: int
    backend: str

    @classmethod
    def here(cls, threads: int, backend: str = "ort") -> Fingerprint:
        """This machine running `backend`. The native backend is its kernels' build too: a record measured
        with other kernel sources never answers for these."""
        import onnxruntime

        if backend == "native":
            from specrt.engines.native import library

            backend = f"native (kernels {library.digest(library.compiler() or '')})"
        return cls(cpu_model(), tuple(simd_features()), onnxruntime.__version__, int(threads), backend)

    @property
    def key(self) -> str:
        """A short stable id of this fingerprint (manifest and cache keys)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["features"] = list(self.features)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        return cls(d["cpu"], tuple(d["features"]), d["onnxruntime"], int(d["threads"]), d["backend"])

    def describe(self) -> str:
        simd = ",".join(f for f in self.features if f.startswith(("avx", "amx", "sve", "asimd"))) or "no AVX"
        return f"{self.cpu} [{simd}], onnxruntime {self.onnxruntime}, {self.threads} threads, {self.backend}"
