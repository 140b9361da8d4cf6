"""Whole-process wall time of two commands, run in turn A B A B …, and the ratio A/B pair by pair.

    python scripts/paired_wall.py -n 7 --a "specrt generate … --drafter ngram" --b "OLD_CHECKOUT/bin/specrt generate …"

Each run is a fresh process (its start-up and session load included), as users run specrt; pairing
keeps the ratio meaningful while the machine's speed drifts. Prints min, median and max of A's and B's
wall seconds and of A/B; quote the median. One warm-up pair is not counted.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import time


def wall(command: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(shlex.split(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="counted pairs")
    ap.add_argument("--a", required=True, help="command A (one string, split as a shell splits words)")
    ap.add_argument("--b", required=True, help="command B, the baseline")
    args = ap.parse_args()
    wall(args.a), wall(args.b)  # warm-up: file caches, compiled artefacts
    a, b = [], []
    for _ in range(args.n):
        a.append(wall(args.a))
        b.append(wall(args.b))
    for name, xs in (("A wall s", a), ("B wall s", b), ("A/B wall", [x / y for x, y in zip(a, b, strict=True)])):
        print(f"{name:10} min {min(xs):.4f}  median {statistics.median(xs):.4f}  max {max(xs):.4f}")


if __name__ == "__main__":
    main()
