"""The native kernels' shared library: compiled from `csrc/` with the machine's C++ compiler on first use,
cached by the sources' digest, loaded with ctypes.

    python -m specrt.engines.native.library      build it now (`make setup` does), print the kernels here

The library is `$SPECRT_HOME/cache/native/<digest>/libspecrt_native.so`, written to a temporary name and
renamed, so a failed or interrupted compile leaves nothing half-written. Which kernel runs (`kernel()`) is a
branch (specrt/branches.py, SPECRT_NATIVE_KERNEL): `auto` takes the fastest one this CPU executes; every
kernel computes bitwise the same values (csrc/w4a8.h, csrc/ops.inc), and a forced one the CPU lacks is
refused naming what it needs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from specrt.errors import SpecrtError

SOURCES = Path(__file__).with_name("csrc")
FILES = ("w4a8.h", "w4a8.cpp", "pool.h", "arena.h", "ops.h", "ops.inc", "ops_ref.cpp", "ops_avx2.cpp", "x86_attend.inc",
         "ops_avx512.cpp", "model.cpp")
UNITS = ("model.cpp", "w4a8.cpp", "ops_ref.cpp", "ops_avx2.cpp", "ops_avx512.cpp")
# -ffp-contract=off: no float operation is fused behind the code's back, so the kernels built for different
# instruction sets compute the same values (csrc/ops.inc)
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-ffp-contract=off", "-fno-math-errno",
         "-Wno-maybe-uninitialized")
LIB_NAME = "libspecrt_native.so"
# kernel name -> the library's code for it (csrc/w4a8.h Isa), fastest last; what each needs from the CPU
KERNELS = {"scalar": 0, "avx2": 1, "avx512vnni": 2, "amx": 3}
MAX_THREADS = 1024  # csrc/model.cpp kMaxThreads: more is a mistake, not a machine
NEEDS = {"scalar": "nothing", "avx2": "AVX2, FMA and F16C", "avx512vnni": "AVX-512 F/BW/VL, AVX-512 VNNI and F16C",
         "amx": "AMX tiles and int8 (with the OS's tile state) and AVX-512 VBMI besides what avx512vnni needs"}

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "spn_last_error": (ctypes.c_char_p, []),
    "spn_isa_supported": (I32, [I32]),
    "spn_model_new": (P, [I32, I32, I32, I32, I32, I32, I32, F32, F32, I32, I32, I32]),
    "spn_model_free": (None, [P]),
    "spn_model_pages": (I32, [P, P]),
    "spn_set_embed": (I32, [P, P, I64, I64]),
    "spn_use_embed": (I32, [P, P, I64, I64]),
    "spn_use_embed_blocks": (I32, [P, P, I64, P, I64, I64, I64, I32]),
    "spn_set_norm": (I32, [P, I32, I32, P, I64]),
    "spn_set_linear": (I32, [P, I32, I32, I32, I32, I32, P, I64, P, I64, P, I64, P, I64]),
    "spn_set_rope": (I32, [P, I32, I32, P, P]),
    "spn_set_taps": (I32, [P, I32, P]),
    "spn_set_kv_format": (I32, [P, I32]),
    "spn_to_half": (I32, [I32, P, I64, P]),
    "spn_pass": (I32, [P, I32, I32, P, P, P, P, I32, P, P, I64, I32, P, P, P]),
    "spn_pass_ragged": (I32, [P, I32, P, P, P, P, P, P, P, P, I64, I32, P, P, P]),
    "spn_feature_pass": (I32, [P, I32, P, P, P, I64, P, P, P, I32, P, P, I32, P, P]),
    "spn_linear_new": (P, [I32, I32, I32, P, I64, P, I64, P, I64, P, I64]),
    "spn_linear_free": (None, [P]),
    "spn_linear_factors": (I32, [P]),
    "spn_linear_run": (I32, [P, I32, I32, I32, P, I64, P, I64]),
}


def compiler() -> str | None:
    """The C++ compiler to build with: $CXX, else g++ or c++ on PATH; None when there is none."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def digest(cxx: str) -> str:
    h = hashlib.sha256()
    for name in FILES:
        h.update(name.encode() + b"\0" + (SOURCES / name).read_bytes())
    h.update(" ".join((cxx, *FLAGS, platform.machine())).encode())
    return h.hexdigest()[:16]


def library_path(cxx: str) -> Path:
    from specrt.paths import home

    return home() / "cache" / "native" / digest(cxx) / LIB_NAME


def _record_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".json")


def _fingerprint(path: Path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verified(out: Path) -> bool:
    """The cached library is the one this machine built: its size and digest are what the build recorded. A
    truncated, empty or overwritten file is not (dlopen of a truncated one dies with a bus error)."""
    try:
        return out.is_file() and json.loads(_record_path(out).read_text()) == _fingerprint(out)
    except (OSError, ValueError):
        return False


def _cache_error(folder: Path, e: OSError) -> SpecrtError:
    return SpecrtError(f"the native kernels' cache {folder} is not writable ({e.strerror or e}): set SPECRT_HOME to a "
                       "writable folder; --backend ort runs without the kernels")


def build(quiet: bool = True) -> Path:
    """The compiled library, built now if this machine has none for these sources, or the one cached fails
    its check (_verified): it is then built again. Every failure is a SpecrtError of one line."""
    cxx = compiler()
    if cxx is None:
        raise SpecrtError("the native backend compiles its kernels on first use and no C++ compiler was found "
                          "(set CXX, or `apt-get install g++`); --backend ort runs without one")
    out = library_path(cxx)
    if _verified(out):
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=LIB_NAME, suffix=".tmp")
        os.close(fd)
    except OSError as e:
        raise _cache_error(out.parent, e) from None
    record_tmp = tmp + ".json"
    cmd = [cxx, *FLAGS, "-o", tmp, *(str(SOURCES / u) for u in UNITS)]
    if not quiet:
        what = "the cached one failed its check, " if out.exists() else ""
        print(f"specrt: compiling the native kernels ({what}{Path(cxx).name}, a few seconds, once)", file=sys.stderr)
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise SpecrtError(f"the C++ compiler {cxx} could not be run ({e.strerror or e}): set CXX to a working "
                              "compiler; --backend ort runs without the native kernels") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise SpecrtError(f"compiling the native kernels failed ({' '.join(cmd[:2])} …): {tail[0][:300]}; "
                              "--backend ort runs without them")
        try:  # the record first: a library in place always has the record it is checked by
            Path(record_tmp).write_text(json.dumps(_fingerprint(Path(tmp))))
            os.replace(record_tmp, _record_path(out))
            os.replace(tmp, out)
        except OSError as e:
            raise _cache_error(out.parent, e) from None
    finally:
        for leftover in (tmp, record_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return out


@functools.cache
def load() -> ctypes.CDLL:
    """The library, its functions typed."""
    path = build(quiet=False)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise SpecrtError(f"the native kernels at {path} could not be loaded ({e}): delete that file to build them "
                          "again; --backend ort runs without them") from None
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def supported(name: str) -> bool:
    return bool(load().spn_isa_supported(KERNELS[name]))


def available() -> list[str]:
    """The kernels this CPU executes, fastest last."""
    return [k for k in KERNELS if supported(k)]


def kernel(requested: str = "auto") -> tuple[str, dict]:
    """The kernel to run and its branch record: `requested` (or SPECRT_NATIVE_KERNEL) when not auto, else the
    fastest this CPU executes."""
    from specrt.branches import pick, record

    choice = pick("native_kernel", requested)
    if choice.value == "auto":
        name = available()[-1]
        return name, record(choice, name, f"the fastest kernel this CPU executes ({', '.join(available())})")
    if not supported(choice.value):
        raise SpecrtError(f"native kernel {choice.value!r} ({choice.forced_by}) needs {NEEDS[choice.value]}, which "
                          f"this CPU lacks: choose one of {', '.join(available())} or auto")
    return choice.value, record(choice, choice.value)


def last_error() -> str:
    return load().spn_last_error().decode(errors="replace")


def main() -> None:
    path = build(quiet=False)
    print(f"{path}: kernels here: {', '.join(available())}; auto runs {kernel()[0]}")


if __name__ == "__main__":
    main()
