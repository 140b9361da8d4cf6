"""Where a serving step's time goes, without HTTP: the scheduler stepped in this thread over N requests.

    python scripts/serve_steps.py BUNDLE [--users 1,4,16] [--requests 48] [--max-tokens 128] [--threads 2]
                                         [--kv-dtype auto|fp32|fp16|int8] [--prefix-cache-mb MB]

For each user count: that many KV slots, `--requests` distinct held-out chat prompts all queued at once,
greedy plain decoding, stepped until every request ends. Prints tokens/s, the seconds in target passes and
in everything else (plan, apply, delivery), the steps, the mean sequences per decode pass and the prompt
rows per second. Each user count starts a fresh server (an empty prefix cache): distinct prompts share only
the chat template's system prompt. Compare its tokens/s with `specrt bench-serve --process` at the same users: the
difference is what the HTTP server and its clients cost.
"""

from __future__ import annotations

import argparse
import time

from specrt.cli.bench_cmd import prompt_set
from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler


def run(bundle: str, users: int, prompts: list[str], max_tokens: int, threads: int, kv_dtype: str = "auto",
        prefix_cache_mb: int = 0) -> dict:
    gen = Generator(bundle, drafter="plain", max_seq_len=1024, slots=users, threads=threads, kv_dtype=kv_dtype)
    passes = {"seconds": 0.0, "rows": 0}

    def runner(bp):
        t0 = time.perf_counter()
        outs = gen.model.run_batch(bp.windows, bp.start)
        passes["seconds"] += time.perf_counter() - t0
        passes["rows"] += sum(len(w.window) for w in bp.windows if w is not None and len(w.rows))
        return outs

    scheduler = Scheduler(gen, max_waiting=len(prompts), runner=runner, prefix_cache_mb=prefix_cache_mb)
    ids = [gen.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    handles = [scheduler.submit(x, max_tokens) for x in ids]
    t0 = time.perf_counter()
    while scheduler.running or scheduler.waiting:
        scheduler.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(h.wait().token_ids) for h in handles)
    batches = list(scheduler.batch_sizes)
    return {"users": users, "tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "pass_s": round(passes["seconds"], 2), "other_s": round(wall - passes["seconds"], 2),
            "steps": scheduler.steps, "mean_batch": round(sum(batches) / max(len(batches), 1), 2),
            "rows": passes["rows"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--users", default="1,4,16")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "fp16", "int8"])
    ap.add_argument("--prefix-cache-mb", type=int, default=0, help="the prefix cache's size (0: none)")
    args = ap.parse_args()
    prompts = [p.prompt for p in prompt_set("heldout", None)][: args.requests]
    print("| users | tok/s | s | in passes s | other s | decode steps | mean batch | rows run |")
    print("|---|---|---|---|---|---|---|---|")
    for users in (int(u) for u in args.users.split(",")):
        r = run(args.bundle, users, prompts, args.max_tokens, args.threads, args.kv_dtype, args.prefix_cache_mb)
        print(f"| {r['users']} | {r['tokens_per_s']} | {r['seconds']} | {r['pass_s']} | {r['other_s']} | {r['steps']} "
              f"| {r['mean_batch']} | {r['rows']} |", flush=True)


if __name__ == "__main__":
    main()
