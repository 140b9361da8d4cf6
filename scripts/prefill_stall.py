"""How long a long prompt stalls a stream that is already decoding, on the serving scheduler.

    python scripts/prefill_stall.py BUNDLE [--prompt-tokens 2000] [--threads 2]

Stream A (a short chat prompt, 400 tokens) decodes; once it has 20 tokens, request B arrives with a
prompt of --prompt-tokens tokens. Prints A's longest gap between two deliveries while B prefills, B's
time to first token, and A's median gap before B arrived.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from specrt.runtime.generate import Generator
from specrt.serving.scheduler import Scheduler

WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches".split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    gen = Generator(args.bundle, drafter="plain", max_seq_len=args.prompt_tokens + 600, slots=2, threads=args.threads)
    scheduler = Scheduler(gen).start()
    a_ids = gen.tokenizer.encode_prompt("Write a long story about a lighthouse keeper.")
    text = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_tokens))
    b_ids = gen.tokenizer.encode_prompt(text, raw=True)[: args.prompt_tokens]
    times: list[float] = []
    a = scheduler.submit(a_ids, 400)
    done = threading.Event()

    def consume():
        for _ in a:
            times.append(time.perf_counter())
        done.set()

    threading.Thread(target=consume, daemon=True).start()
    while len(times) < 20:
        time.sleep(0.005)
    t_b = time.perf_counter()
    b = scheduler.submit(b_ids, 4)
    first_b = next(iter(b))
    ttft = time.perf_counter() - t_b
    assert first_b
    b.wait()
    a.cancel()
    done.wait(60)
    scheduler.stop()
    t = np.array(times)
    gaps = np.diff(t)
    before = gaps[t[1:] < t_b]
    during = gaps[(t[1:] >= t_b) & (t[:-1] <= t_b + ttft)]
    print(f"B: {len(b_ids)} prompt tokens, time to first token {ttft:.2f} s; A's gaps: median before B "
          f"{np.median(before) * 1000:.0f} ms, longest while B prefilled {during.max() * 1000:.0f} ms")


if __name__ == "__main__":
    main()
