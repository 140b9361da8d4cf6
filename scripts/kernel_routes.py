"""Time CPU matmul routes over a whole model's matmuls at M = 1, 2, 4, 8, 16, 32 rows, each in its own process.

    python scripts/kernel_routes.py                          every route, one process each, then a table
    python scripts/kernel_routes.py --markdown FILE          the same, the table also written to FILE
    python scripts/kernel_routes.py --route ort-matmulnbits  one route here, one JSON line

The matmuls are SmolLM2-135M's: 30 layers x (qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576) and
the LM head 576x49152, 121 in all, random weights (seed 0), every layer its own. One repeat is one sweep
of all 121 on M rows (x576 [M, 576], x1536 [M, 1536]); a cell is the median ms of the repeats after the
warm-ups. Routes: ONNX Runtime's MatMulNBits (int4, block 32, symmetric, accuracy_level 4), an ONNX W8A8
graph (per-row u8 activations, zero point 128, MatMulInteger on s8 weights, scales after), and specrt's
own W4A8 kernels (engines/native) through ctypes. "row(M) == row(1)" compares row 0 of every M-row output
with the 1-row output of the same input row: "bitwise", else the max |diff| over every M.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np

ROUTES = ("ort-matmulnbits", "ort-w8a8", "native-scalar", "native-avx2", "native-avx512vnni", "native-amx")
MS = (1, 2, 4, 8, 16, 32)
LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N): qkv, o, gate_up, down
SHAPES = [kn for _ in range(30) for kn in LAYER] + [(576, 49152)]  # + LM head
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx")


def inputs() -> dict[int, np.ndarray]:
    rng = np.random.default_rng(1)
    return {k: rng.standard_normal((max(MS), k), dtype=np.float32) for k in (576, 1536)}


def int4_weights():
    """Per matmul: q uint8 [N, K/32, 16] (MatMulNBits packing, zero point 8) and scales float32 [N, K/32]."""
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        q = rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8)
        yield k, n, q, rng.uniform(0.001, 0.003, (n, k // 32)).astype(np.float32)


def int8_weights():
    """Per matmul: s8 weights [K, N] and per-column scales float32 [N]."""
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        yield k, n, rng.integers(-127, 128, (k, n), dtype=np.int8), rng.uniform(0.001, 0.003, n).astype(np.float32)


def onnx_graph(route: str) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    nodes, inits, outs = [], [], []
    xs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, ["M", k]) for k in (576, 1536)]
    if route == "ort-matmulnbits":
        for i, (k, n, q, s) in enumerate(int4_weights()):
            inits += [numpy_helper.from_array(q, f"B{i}"), numpy_helper.from_array(s.reshape(-1), f"S{i}")]
            nodes.append(helper.make_node("MatMulNBits", [f"x{k}", f"B{i}", f"S{i}"], [f"y{i}"], domain="com.microsoft",
                                          K=k, N=n, bits=4, block_size=32, accuracy_level=4))
            outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]))
    else:  # ort-w8a8: every matmul quantizes its own input, as in a model where each has a different one
        c = {"axes": np.array([1], np.int64), "c127": np.float32(127), "zp": np.uint8(128), "zpf": np.float32(128),
             "lo": np.float32(0), "hi": np.float32(255)}
        inits += [numpy_helper.from_array(np.asarray(v), name) for name, v in c.items()]
        for i, (k, n, w, s) in enumerate(int8_weights()):
            inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(s, f"S{i}")]
            p = f"n{i}_"
            nodes += [helper.make_node("Abs", [f"x{k}"], [p + "abs"]),
                      helper.make_node("ReduceMax", [p + "abs", "axes"], [p + "max"], keepdims=1),
                      helper.make_node("Div", [p + "max", "c127"], [p + "rs"]),
                      helper.make_node("Div", [f"x{k}", p + "rs"], [p + "xs"]),
                      helper.make_node("Round", [p + "xs"], [p + "xr"]),
                      helper.make_node("Add", [p + "xr", "zpf"], [p + "xz"]),
                      helper.make_node("Clip", [p + "xz", "lo", "hi"], [p + "xc"]),
                      helper.make_node("Cast", [p + "xc"], [p + "xq"], to=TensorProto.UINT8),
                      helper.make_node("MatMulInteger", [p + "xq", f"W{i}", "zp"], [p + "acc"]),
                      helper.make_node("Cast", [p + "acc"], [p + "accf"], to=TensorProto.FLOAT),
                      helper.make_node("Mul", [p + "accf", p + "rs"], [p + "yr"]),
                      helper.make_node("Mul", [p + "yr", f"S{i}"], [f"y{i}"])]
            outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["M", n]))
    graph = helper.make_graph(nodes, route, xs, outs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def ort_sweep(route: str, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(onnx_graph(route), so, providers=["CPUExecutionProvider"])
    xs = inputs()
    return lambda m: sess.run(None, {f"x{k}": x[:m] for k, x in xs.items()})


def native_sweep(name: str, threads: int):
    from specrt.engines.native import calls, library
    from specrt.engines.native.weights import Linear

    lib, code, xs = library.load(), library.KERNELS[name], inputs()
    handles = [(k, n, calls.linear_new(lib, Linear(k, n, q.reshape(n, -1, 16), s.reshape(n, -1))))
               for k, n, q, s in int4_weights()]
    # NaN-filled: an output a kernel leaves unwritten shows up as non-finite, not as stale equal values
    ys = {m: [np.full((m, n), np.nan, np.float32) for _, n, _ in handles] for m in MS}

    def sweep(m: int) -> list[np.ndarray]:
        for (k, _, h), y in zip(handles, ys[m], strict=True):
            if calls.linear_run(lib, h, code, threads, np.ascontiguousarray(xs[k][:m]), y) != 0:
                raise RuntimeError(f"spn_linear_run failed: {library.last_error()}")
        return ys[m]

    return sweep


def measure(route: str, threads: int, warmup: int, repeats: int) -> dict:
    if route.startswith("native-"):
        from specrt.engines.native import library

        name = route.removeprefix("native-")
        if not library.supported(name):
            return {"route": route, "unsupported": f"needs {library.NEEDS[name]}"}
        sweep, extra = native_sweep(name, threads), {"library": library.load()._name}
    else:
        sweep, extra = ort_sweep(route, threads), {}
    ms_list = MS[:3] if route == "native-scalar" else MS
    warmup, repeats = (1, 2) if route == "native-scalar" else (warmup, repeats)
    ms, diff, same, finite, row1 = {}, {}, [], True, None
    for m in ms_list:
        for _ in range(warmup):
            ys = sweep(m)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ys = sweep(m)
            times.append(time.perf_counter() - t0)
        ms[m] = round(1e3 * float(np.median(times)), 3)
        rows = [y[0].copy() for y in ys]
        row1 = row1 or rows
        finite = finite and all(np.isfinite(y).all() for y in ys)
        same += [a.tobytes() == b.tobytes() for a, b in zip(rows, row1, strict=True)]
        diff[m] = max(float(np.max(np.abs(a - b))) for a, b in zip(rows, row1, strict=True))
    return {"route": route, "threads": threads, "ms": ms, "diff": diff, "bitwise": all(same),
            "finite": finite, **extra}


def cpu_lines() -> list[str]:
    import onnxruntime as ort

    info = open("/proc/cpuinfo").read()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in info.splitlines() if ln.startswith("flags")), set())
    omp = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "GOMP_")))
    simd = sorted(f for f in flags if any(f.startswith(p) for p in FLAGS))
    return [f"CPU: {model} ({os.cpu_count()} logical CPUs); SIMD flags: {' '.join(simd) or 'none of ' + ' '.join(FLAGS)}",
            f"onnxruntime {ort.__version__}; OpenMP environment: {omp or 'none set'}",
            f"command: `{shlex.join(sys.orig_argv)}`"]


def table(results: list[dict]) -> str:
    head = "| route | " + " | ".join(f"M={m}" for m in MS) + " | 32/1 | row(M) == row(1) |"
    lines = [head, "|" + "---|" * (len(MS) + 3)]
    for r in results:
        if "unsupported" in r or "error" in r:
            why = r.get("unsupported") and f"unsupported on this CPU ({r['unsupported']})" or r["error"]
            lines.append(f"| {r['route']} | " + " | ".join("–" for _ in MS) + f" | – | {why} |")
            continue
        ms = {int(k): v for k, v in r["ms"].items()}
        cells = [f"{ms[m]:.2f}" if m in ms else "–" for m in MS]
        ratio = f"{ms[32] / ms[1]:.2f}" if 32 in ms else "–"
        same = "bitwise" if r["bitwise"] else f"max \\|diff\\| {max(r['diff'].values()):.3g}"
        same = same if r["finite"] else "non-finite outputs (NaN/inf, or left unwritten)"
        lines.append(f"| {r['route']} | " + " | ".join(cells) + f" | {ratio} | {same} |")
    return "\n".join(lines)


def run_all(args) -> str:
    results = []
    for route in args.routes:
        print(f"kernel_routes: {route} …", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--route", route, "--threads", str(args.threads),
               "--warmup", str(args.warmup), "--repeats", str(args.repeats)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"route": route, "error": f"failed (rc {done.returncode}): {tail[:200]}"})
        else:
            results.append(json.loads(lines[-1]))
    libs = sorted({r["library"] for r in results if "library" in r})
    notes = [f"{args.threads} threads", *cpu_lines(), *(f"native library: {lib}" for lib in libs)]
    return table(results) + "\n\n" + "\n".join(f"- {ln}" for ln in notes) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--route", choices=ROUTES, help="measure this route here and print one JSON line")
    ap.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES), help="the routes of the table")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--markdown", help="also write the table and its notes to this file")
    args = ap.parse_args()
    if args.route:
        print(json.dumps(measure(args.route, args.threads, args.warmup, args.repeats)))
        return
    text = run_all(args)
    print(text, end="")
    if args.markdown:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.markdown)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, args.markdown)


if __name__ == "__main__":
    main()
