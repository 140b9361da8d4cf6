"""Time one target pass shape of a bundle through specrt's own runtime, in this process only.

    python scripts/pass_costs.py prefill BUNDLE --tokens 2000      a prompt's prefill (in the runtime's
                                                                   chunks), seconds and peak RSS
    python scripts/pass_costs.py verify BUNDLE --context 200       verify(k) for k = 1, 2, 4, ..., 32, in
                                                                   interleaved rounds: median ms, and the
                                                                   median ratio to the round's 1-row pass
    python scripts/pass_costs.py batch BUNDLE --users 16 --contexts 128,512,900 --kv-dtype fp16
                                                                   one decode pass over N sequences (a row
                                                                   each) at each context: the median ms
    python scripts/pass_costs.py prefill-ortgenai MODEL_DIR --tokens 2000   the same prefill in
                                                                   onnxruntime-genai (`make peer-models`)

Run each in its own process (peak RSS is the process's); token ids are random (seed 0), so a
measurement needs no tokenizer. Used for docs/performance.md's prefill and pass-cost tables.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _branch(gen) -> dict:
    """The backend and, for the native one, the kernel branch it took (and who chose it)."""
    dec = gen.target
    out = {"backend": gen.backend}
    if getattr(dec, "kernel_record", None):
        out["kernel"] = dec.kernel_record
    return out


def prefill(bundle: str, tokens: int, threads: int, backend: str = "ort") -> dict:
    from specrt.runtime.generate import Generator

    gen = Generator(bundle, "plain", max_seq_len=tokens + 64, threads=threads, backend=backend)
    ids = np.random.default_rng(0).integers(0, gen.manifest.target.config.vocab_size, tokens).tolist()
    gen.forward(ids[:8], 0, rows=[7])  # warm-up
    seq = gen.sequence(ids, 1)
    t0 = time.perf_counter()
    for p in seq.prefill_passes():
        gen.run_pass(p)
    seconds = time.perf_counter() - t0
    return {"engine": "specrt", "tokens": tokens, "seconds": round(seconds, 3),
            "ms_per_token": round(1e3 * seconds / tokens, 3), "peak_rss_mb": round(_rss_mb()),
            "exec_mode": gen.exactness.mode.name, **_branch(gen)}


def verify(bundle: str, context: int, threads: int, rounds: int = 40, backend: str = "ort",
           ks: tuple[int, ...] = (1, 2, 4, 8, 16, 32), kv_dtype: str = "auto") -> dict:
    """verify(k): each round runs one pass of every k, in an order rotated round by round, so a VM whose speed
    drifts moves every k alike. verify_ms: the median ms of each k's passes; ratio_to_1: the median over rounds of
    k's pass over the same round's one-row pass (the figure issue 44 bounds)."""
    from specrt.runtime.generate import Generator

    gen = Generator(bundle, "plain", max_seq_len=context + 64, threads=threads, backend=backend, kv_dtype=kv_dtype)
    rng = np.random.default_rng(0)
    vocab = gen.manifest.target.config.vocab_size
    gen.forward(rng.integers(0, vocab, context).tolist(), 0, rows=[context - 1])
    for k in ks:  # warm-up: every shape once
        gen.forward(rng.integers(0, vocab, k).tolist(), context)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(rounds):
        for k in ks[r % len(ks):] + ks[:r % len(ks)]:
            window = rng.integers(0, vocab, k).tolist()
            t0 = time.perf_counter()
            gen.forward(window, context)
            times[k].append(time.perf_counter() - t0)
    ms = {k: round(1e3 * float(np.median(v)), 2) for k, v in times.items()}
    base = np.asarray(times[ks[0]])
    ratio = {k: round(float(np.median(np.asarray(v) / base)), 3) for k, v in times.items()}
    return {"engine": "specrt", "context": context, "rounds": rounds, "verify_ms": ms,
            f"ratio_to_{ks[0]}": ratio, "exec_mode": gen.exactness.mode.name, **_branch(gen)}


def batch(bundle: str, users: int, contexts: list[int], threads: int, kv_dtype: str, repeats: int = 15) -> dict:
    """A serving decode step's pass: `users` sequences of one new row each, every one `context` rows into its
    cache (the cache's values do not change what a pass costs), the median ms of `repeats` passes."""
    from specrt.runtime.generate import Generator

    gen = Generator(bundle, "plain", max_seq_len=max(contexts) + 64, slots=users, threads=threads, backend="native",
                    kv_dtype=kv_dtype)
    dec = gen.target
    dec.select(0, users)
    rng = np.random.default_rng(0)
    vocab = gen.manifest.target.config.vocab_size
    ms = {}
    for context in contexts:
        times = []
        for _ in range(repeats):
            ids = rng.integers(0, vocab, (users, 1))
            t0 = time.perf_counter()
            dec.run_all(ids, np.full((users, 1), context), np.full(users, context), np.ones((users, 1, 1), bool),
                        np.zeros((users, 1), np.int64))
            times.append(time.perf_counter() - t0)
        ms[context] = round(1e3 * float(np.median(times)), 2)
    return {"engine": "specrt", "users": users, "kv_dtype": dec.kv_dtype, "pass_ms": ms, **_branch(gen)}


def prefill_ortgenai(model_dir: str, tokens: int, threads: int) -> dict:
    import onnxruntime_genai as og

    cfg = og.Config(model_dir)
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(cfg)
    ids = np.random.default_rng(0).integers(0, 40000, tokens).astype(np.int32)

    def run(n: int) -> float:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=n + 8, do_sample=False)
        g = og.Generator(model, params)
        t0 = time.perf_counter()
        g.append_tokens(ids[:n])
        return time.perf_counter() - t0

    run(8)  # warm-up
    seconds = run(tokens)
    return {"engine": "onnxruntime-genai", "tokens": tokens, "seconds": round(seconds, 3),
            "ms_per_token": round(1e3 * seconds / tokens, 3), "peak_rss_mb": round(_rss_mb())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prefill", "verify", "batch", "prefill-ortgenai"])
    ap.add_argument("path", help="a bundle folder (an onnxruntime-genai model folder for prefill-ortgenai)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="ort", help="the target's backend (engines/registry.py)")
    ap.add_argument("--rounds", type=int, default=40, help="verify: rounds of one pass of every k")
    ap.add_argument("--ks", default="1,2,4,8,16,32", help="verify: the row counts, the first the ratios' base")
    ap.add_argument("--users", type=int, default=16, help="batch: the sequences in the pass")
    ap.add_argument("--contexts", default="16,128,256,512,900", help="batch: the cache rows each sequence has")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "fp16", "int8"], help="verify, batch: the cache")
    a = ap.parse_args()
    if a.what == "prefill":
        out = prefill(a.path, a.tokens, a.threads, a.backend)
    elif a.what == "verify":
        ks = tuple(int(k) for k in a.ks.split(","))
        if not ks or min(ks) < 1:
            ap.error(f"--ks {a.ks!r}: give row counts of 1 or more, e.g. 1,2,4")
        out = verify(a.path, a.context, a.threads, a.rounds, a.backend, ks, a.kv_dtype)
    elif a.what == "batch":
        out = batch(a.path, a.users, [int(c) for c in a.contexts.split(",")], a.threads, a.kv_dtype)
    else:
        out = prefill_ortgenai(a.path, a.tokens, a.threads)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
