#!/usr/bin/env python3
"""GPU check of specrt's Triton kernels on a CUDA machine (torch + triton): correctness, timing, CUDA graphs.

    python scripts/gpu_check.py [--out DIR] [--quick]        (make gpu-check)

1. correctness: `tree_attention` (fp32, fp16) and `rejection_sample` (with draft distributions and
   one-hot drafts) on CUDA tensors against the NumPy references beside the ops
   (specrt.plugins.tree_attention.reference, rejection_sample.rejection_sample_reference): max errors,
   identical path / next-token counts, and the tree ↔ chain bitwise property of TreeAttention (a tree
   node's output equals the last row of a chain holding only its ancestors);
2. timing: median of CUDA-event-timed launches after warm-up;
3. CUDA graph: one decode-like step (TreeAttention + an output projection matmul on static buffers)
   captured once and replayed on new inputs; replay output must equal eager output bitwise; replay
   vs eager time.

Writes DIR/report.md and DIR/report.json (DIR: $SPECRT_HOME/gpu_check, else ./artifacts/gpu_check).
Exit 0: every check passed; 1: a check failed; 2: no CUDA GPU with torch + triton here (nothing run).
`--interpret` (development only) runs the correctness part on CPU tensors under Triton's interpreter
with tiny shapes; timing and CUDA graphs are then skipped and reported as not run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REQUIRES = "gpu_check: a CUDA GPU with torch+triton is required (nothing was run)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="report folder (default $SPECRT_HOME/gpu_check)")
    ap.add_argument("--quick", action="store_true", help="fewer cases and timing iterations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def environment_or_exit(interpret: bool):
    """Import torch + triton + the kernels; exit 2 with one line when this machine cannot run them."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # must be decided before the kernel modules are imported
    try:
        import torch
        import triton  # noqa: F401
    except ImportError:
        print(REQUIRES, file=sys.stderr)
        sys.exit(2)
    if not interpret and not torch.cuda.is_available():
        print(REQUIRES, file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without `pip install -e .`
    return torch


# ── cases ────────────────────────────────────────────────────────────────────────────────────────
def random_parents(rng, m: int):
    """A depth-sorted random tree: parents[0] = -1, parents[c] in [0, c)."""
    import numpy as np

    parents = np.full(m, -1, np.int64)
    for c in range(1, m):
        parents[c] = rng.integers(max(0, c - 3), c)  # bushy near the end, deep overall
    return parents


def ancestor_mask(parents):
    """tree_mask[t, u]: window node t sees node u (u is t or an ancestor) — the runtime's own Tree."""
    from specrt.runtime.tree import Tree

    return Tree.from_parents([int(p) for p in parents]).mask


def tree_attention_cases(quick: bool, interpret: bool):
    """(name, B, H, KV, T, d, S, past_lens, dtype)."""
    if interpret:
        return [
            ("tiny tree fp32", 2, 4, 2, 5, 16, 48, [7, 33], "float32"),
            ("tiny decode fp16", 1, 4, 1, 1, 16, 40, [35], "float16"),
        ]
    cases = [
        ("decode T=1 fp32", 1, 9, 3, 1, 64, 2048, [1000], "float32"),
        ("chain T=5 fp32", 2, 9, 3, 5, 64, 2048, [17, 1500], "float32"),
        ("tree T=16 fp32", 2, 9, 3, 16, 64, 2048, [0, 777], "float32"),
        ("tree T=16 fp16", 2, 9, 3, 16, 64, 2048, [31, 1024], "float16"),
        ("tree T=32 bf16", 1, 32, 8, 32, 128, 4096, [3000], "bfloat16"),
    ]
    return cases[:3] if quick else cases


def run_tree_attention(torch, dev, rng, quick, interpret):
    import numpy as np

    from specrt.plugins.tree_attention import reference
    from specrt.plugins.triton_kernels.tree_attention import tree_attention

    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
    rows = []
    for name, b, h, kv, t, d, s, past, dtype in tree_attention_cases(quick, interpret):
        tdt = getattr(torch, dtype)
        parents = [random_parents(rng, t) if "tree" in name else np.arange(-1, t - 1) for _ in range(b)]
        mask = np.stack([ancestor_mask(p) for p in parents])
        q = torch.from_numpy(rng.standard_normal((b, h, t, d)).astype(np.float32) / np.sqrt(d)).to(dev, tdt)
        k = torch.from_numpy(rng.standard_normal((b, kv, s, d)).astype(np.float32)).to(dev, tdt)
        v = torch.from_numpy(rng.standard_normal((b, kv, s, d)).astype(np.float32)).to(dev, tdt)
        past_len = torch.tensor(past, dtype=torch.int64, device=dev)
        out = tree_attention(q, k, v, past_len, torch.from_numpy(mask).to(dev))
        ref = reference(*(x.float().cpu().numpy() for x in (q, k, v)), np.asarray(past), mask)
        err = float(np.abs(out.float().cpu().numpy() - ref).max())
        # tree ↔ chain: node t's row equals the last row of a chain of its ancestors-or-self (bitwise)
        same = total = 0
        if t > 1:
            for bi in range(b):
                for node in range(t):
                    anc = [u for u in range(t) if mask[bi, node, u]]  # by depth (depth-sorted window)
                    p = past[bi]
                    kc, vc = k[bi : bi + 1].clone(), v[bi : bi + 1].clone()
                    kc[:, :, p : p + len(anc)] = k[bi : bi + 1, :, [p + u for u in anc]]
                    vc[:, :, p : p + len(anc)] = v[bi : bi + 1, :, [p + u for u in anc]]
                    qc = q[bi : bi + 1, :, anc]
                    chain = np.tril(np.ones((len(anc), len(anc)), bool))[None]
                    oc = tree_attention(qc, kc, vc, past_len[bi : bi + 1], torch.from_numpy(chain).to(dev))
                    same += bool(torch.equal(oc[0, :, -1], out[bi, :, node]))
                    total += 1
        rows.append(
            {
                "case": name,
                "shape": f"B={b} H={h} KV={kv} T={t} d={d} S={s} past={past}",
                "dtype": dtype,
                "max_abs_err": err,
                "tol": tol[dtype],
                "tree_eq_chain": f"{same}/{total}" if total else "n/a",
                "ok": err <= tol[dtype] and same == total,
            }
        )
    return rows


def run_rejection_sample(torch, dev, rng, quick, interpret):
    import numpy as np

    from specrt.plugins.rejection_sample import rejection_sample_reference
    from specrt.plugins.triton_kernels.rejection_sample import rejection_sample

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True)).astype(np.float32)

    configs = (
        [("tiny, draft probs", 6, 50, 6, False), ("tiny, one-hot drafts", 6, 50, 6, True)]
        if interpret
        else [
            ("M=8 V=49152 draft probs", 8, 49152, 64, False),
            ("M=16 V=49152 draft probs", 16, 49152, 64, False),
            ("M=16 V=49152 one-hot drafts", 16, 49152, 64, True),
            ("M=64 V=32000 draft probs", 64, 32000, 32, False),
        ]
    )
    if quick:
        configs = [(n, m, v, max(8, rows // 4), oh) for n, m, v, rows, oh in configs[:3]]
    out = []
    for name, m, v, batch, one_hot in configs:
        base = rng.standard_normal((batch, m, v)).astype(np.float32) * 3.0
        target = softmax(base)
        parents = np.stack([random_parents(rng, m) for _ in range(batch)])
        # node c's token is drawn from q_c, a noisy copy of the target at c's parent (so some are accepted)
        at_parent = np.take_along_axis(base, np.maximum(parents, 0)[:, :, None], axis=1)
        draft = softmax(at_parent + rng.standard_normal((batch, m, v)).astype(np.float32))
        tokens = np.zeros((batch, m), np.int64)
        for bi in range(batch):
            for c in range(1, m):
                p = draft[bi, c].astype(np.float64)
                tokens[bi, c] = rng.choice(v, p=p / p.sum())
        uniforms = rng.random((batch, m), dtype=np.float32)
        to = lambda x: torch.from_numpy(x).to(dev)  # noqa: E731
        path, path_len, nxt = rejection_sample(
            to(target), None if one_hot else to(draft), to(tokens), to(parents), to(uniforms)
        )
        path, path_len, nxt = path.cpu().numpy(), path_len.cpu().numpy(), nxt.cpu().numpy()
        same_path = same_next = accepted = 0
        for bi in range(batch):
            q = np.zeros((m, v), np.float32) if one_hot else draft[bi]
            if one_hot:
                q[np.arange(m), tokens[bi]] = 1.0
            ref_path, ref_next = rejection_sample_reference(
                target[bi], q, tokens[bi], parents[bi], uniforms[bi]
            )
            got = [int(x) for x in path[bi, : int(path_len[bi])]]
            same_path += got == ref_path
            same_next += got == ref_path and int(nxt[bi]) == ref_next
            accepted += len(ref_path)
        out.append(
            {
                "case": name,
                "rows": batch,
                "identical_path": f"{same_path}/{batch}",
                "identical_path_and_next": f"{same_next}/{batch}",
                "mean_accepted": accepted / batch,
                # a decision may flip only when u lands within an ulp of a threshold (per-tile sums)
                "ok": same_next >= batch - max(1, batch // 100),
            }
        )
    return out


# ── timing and CUDA graphs ──────────────────────────────────────────────────────────────────────
def cuda_time(torch, fn, warmup: int, iters: int) -> float:
    """Median milliseconds of fn() between two CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def decode_inputs(torch, dev, rng, b=1, h=9, kv=3, t=8, d=64, s=2048, past=1024, dtype="float16"):
    import numpy as np

    tdt = getattr(torch, dtype)
    mask = torch.from_numpy(np.stack([ancestor_mask(random_parents(rng, t)) for _ in range(b)])).to(dev)
    return {
        "q": torch.randn(b, h, t, d, device=dev, dtype=tdt) / d**0.5,
        "k": torch.randn(b, kv, s, d, device=dev, dtype=tdt),
        "v": torch.randn(b, kv, s, d, device=dev, dtype=tdt),
        "past_len": torch.full((b,), past, dtype=torch.int64, device=dev),
        "mask": mask,
    }


def run_timing(torch, dev, rng, quick):
    from specrt.plugins.triton_kernels.rejection_sample import rejection_sample
    from specrt.plugins.triton_kernels.tree_attention import tree_attention

    warmup, iters = (5, 20) if quick else (20, 100)
    rows = []
    for t, past in ((1, 1024), (8, 1024), (32, 4000)):
        x = decode_inputs(torch, dev, rng, t=t, past=past, s=4096)
        ms = cuda_time(
            torch, lambda x=x: tree_attention(x["q"], x["k"], x["v"], x["past_len"], x["mask"]), warmup, iters
        )
        rows.append(
            {
                "kernel": "tree_attention",
                "shape": f"B=1 H=9 KV=3 d=64 T={t} past={past} fp16",
                "median_ms": ms,
            }
        )
    for m, v in ((8, 49152), (32, 49152)):
        target = torch.softmax(torch.randn(1, m, v, device=dev) * 3, -1)
        draft = torch.softmax(torch.randn(1, m, v, device=dev) * 3, -1)
        tokens = torch.randint(0, v, (1, m), device=dev)
        parents = torch.from_numpy(random_parents(rng, m)[None]).to(dev)
        uniforms = torch.rand(1, m, device=dev)
        for label, q in (("draft probs", draft), ("one-hot", None)):
            ms = cuda_time(
                torch, lambda a=(target, q, tokens, parents, uniforms): rejection_sample(*a), warmup, iters
            )
            rows.append({"kernel": "rejection_sample", "shape": f"B=1 M={m} V={v} {label}", "median_ms": ms})
    return rows


def run_cuda_graph(torch, dev, rng, quick):
    """Capture TreeAttention + output projection on static buffers; replay on new inputs vs eager."""
    from specrt.plugins.triton_kernels.tree_attention import tree_attention

    x = decode_inputs(torch, dev, rng, t=8, past=1024, s=2048)
    b, h, t, d = x["q"].shape
    w = torch.randn(h * d, h * d, device=dev, dtype=x["q"].dtype) / (h * d) ** 0.5

    def step(inp):
        att = tree_attention(inp["q"], inp["k"], inp["v"], inp["past_len"], inp["mask"])  # [B, H, T, d]
        return att.permute(0, 2, 1, 3).reshape(b, t, h * d) @ w

    static = {k: v.clone() for k, v in x.items()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles the kernel) off the capture stream
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static)
    results = []
    for trial in range(3):
        fresh = decode_inputs(torch, dev, rng, t=8, past=900 + 50 * trial, s=2048)
        for k in static:
            static[k].copy_(fresh[k])
        graph.replay()
        eager = step(fresh)
        torch.cuda.synchronize()
        results.append(bool(torch.equal(static_out, eager)))
        diff = float((static_out.float() - eager.float()).abs().max())
    warmup, iters = (5, 20) if quick else (20, 200)
    eager_ms = cuda_time(torch, lambda: step(static), warmup, iters)
    replay_ms = cuda_time(torch, graph.replay, warmup, iters)
    # host-side launch cost matters for small steps: wall time of back-to-back steps
    n = 50 if quick else 200
    for fn, key in ((lambda: step(static), "eager_wall_ms"), (graph.replay, "replay_wall_ms")):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        results.append((key, (time.perf_counter() - t0) * 1e3 / n))
    walls = dict(r for r in results if isinstance(r, tuple))
    equal = [r for r in results if isinstance(r, bool)]
    return {
        "step": "tree_attention(B=1 H=9 KV=3 T=8 d=64, fp16) + [T,576]x[576,576] matmul",
        "replay_equals_eager": f"{sum(equal)}/{len(equal)}",
        "last_max_abs_diff": diff,
        "eager_ms": eager_ms,
        "replay_ms": replay_ms,
        **walls,
        "ok": all(equal),
    }


# ── report ──────────────────────────────────────────────────────────────────────────────────────
def table(rows: list[dict]) -> str:
    if not rows:
        return "(none)\n"
    keys = list(rows[0])
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def markdown(report: dict) -> str:
    env = report["environment"]
    parts = [
        f"# specrt GPU check — {'PASS' if report['ok'] else 'FAIL'}\n",
        f"{env['device']} · torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']} · "
        f"{report['seconds']:.1f} s\n",
        "## TreeAttention vs NumPy reference (float64)\n",
        table(report["tree_attention"]),
        "## RejectionSample vs NumPy reference\n",
        table(report["rejection_sample"]),
    ]
    if report["timing"] is None:
        parts.append("## Timing and CUDA graph\n\nnot run (interpreter mode)\n")
    else:
        parts += [
            "## Kernel timing (CUDA events, median)\n",
            table(report["timing"]),
            "## CUDA graph of one decode-like step\n",
            table([report["cuda_graph"]]),
        ]
    return "\n".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch = environment_or_exit(args.interpret)
    import numpy as np
    import triton

    dev = torch.device("cpu" if args.interpret else "cuda")
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    report = {
        "environment": {
            "device": "CPU (Triton interpreter)" if args.interpret else torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        }
    }
    report["tree_attention"] = run_tree_attention(torch, dev, rng, args.quick, args.interpret)
    report["rejection_sample"] = run_rejection_sample(torch, dev, rng, args.quick, args.interpret)
    report["timing"] = None if args.interpret else run_timing(torch, dev, rng, args.quick)
    report["cuda_graph"] = None if args.interpret else run_cuda_graph(torch, dev, rng, args.quick)
    report["seconds"] = time.perf_counter() - t0
    checks = [r["ok"] for r in report["tree_attention"] + report["rejection_sample"]]
    checks += [] if report["cuda_graph"] is None else [report["cuda_graph"]["ok"]]
    report["ok"] = all(checks)
    out = args.out or Path(os.environ.get("SPECRT_HOME", "artifacts")).resolve() / "gpu_check"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (out / "report.md").write_text(text)
    print(text)
    print(f"wrote {out / 'report.md'} and {out / 'report.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
