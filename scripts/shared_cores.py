"""Plain decoding's ms a step on the native backend alone, then beside other busy processes: what a pass costs
when another process shares the cores (docs/performance.md, "Passes that do not wait for a thread another
process took off its core").

    python scripts/shared_cores.py BUNDLE [--beside specrt,busy] [--rounds 2] [--threads 2]

Each measurement decodes 8 shipped held-out prompts, 96 tokens each, greedy, in a fresh process. `specrt`
beside: a second process decoding with the same bundle and threads in a loop; `busy`: one pure-Python busy
loop per CPU. Prints one line per measurement: the setting and ms a step (the median of `--rounds`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

MEASURE = """
import sys, time
from specrt.cli.bench_cmd import prompt_set
from specrt.runtime.generate import Generator
g = Generator(sys.argv[1], drafter="plain", max_seq_len=1024, backend="native", threads=int(sys.argv[2]))
g.generate_ids(g.tokenizer.encode_prompt("Hello"), 8)
steps, wall = 0, 0.0
for p in prompt_set("heldout", 2)[:8]:
    ids = g.tokenizer.encode_prompt(p.prompt)
    t0 = time.perf_counter(); r = g.generate_ids(ids, 96); wall += time.perf_counter() - t0
    steps += r.stats.steps
print(1e3 * wall / steps)
"""
LOOP = """
import sys
from specrt.runtime.generate import Generator
g = Generator(sys.argv[1], drafter="plain", max_seq_len=1024, backend="native", threads=int(sys.argv[2]))
ids = g.tokenizer.encode_prompt("Write a long story about a lighthouse keeper.")
print("ready", flush=True)
while True:
    g.generate_ids(ids, 200)
"""


def others(kind: str, bundle: str, threads: int) -> list[subprocess.Popen]:
    if kind == "specrt":
        proc = subprocess.Popen([sys.executable, "-c", LOOP, bundle, str(threads)], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()  # loaded and decoding
        return [proc]
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def measure(bundle: str, threads: int) -> float:
    out = subprocess.run([sys.executable, "-c", MEASURE, bundle, str(threads)], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--beside", default="specrt,busy", help="comma-separated: specrt, busy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    settings = ["alone", *[k for k in args.beside.split(",") if k]]
    bad = [k for k in settings[1:] if k not in ("specrt", "busy")]
    if bad:
        ap.error(f"--beside {','.join(bad)}: choose from specrt, busy")
    for setting in settings:
        times = []
        for _ in range(args.rounds):
            procs = [] if setting == "alone" else others(setting, args.bundle, args.threads)
            time.sleep(0.5 if procs else 0)  # let the others reach their loop
            try:
                times.append(measure(args.bundle, args.threads))
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        print(f"{setting:7} ms a step: median {statistics.median(times):.2f}  ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
