"""How often a learned drafter's drafts are accepted at run time, by draft step and within its first step's best
candidates: what runtime/shapes.py sizes default drafts by, measured as the runtime drafts them.

    python scripts/runtime_acceptance.py BUNDLE [--drafter eagle3] [--per-category 3] [--write HEAD_FOLDER]

Runs the shipped held-out prompts (never trained on), greedy, native backend:
- a chain of `--depth` drafts (default 3): a_i = steps that accepted i drafts / steps that accepted i - 1;
- fans of the first step's 2 and 3 best candidates with one draft: A_w = steps that accepted one / steps.

Greedy drafts on the native kernels are the same on every CPU (every kernel computes bitwise the same), so the
numbers belong to the head and the prompts, not the machine. Training's held-out top-1 ran well above them
(0.52 / 0.47 against 0.40 / 0.32 for the shipped EAGLE-3 head), and drafts sized by it were a chain of 2
that ran 1.09x plain where a chain of 1 ran 1.19x (docs/performance.md). `--write` keeps them in the head's
metrics.json ("run_time"), which export copies into the manifest ahead of training's.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from pathlib import Path


def accepted(gen, prompts, max_new_tokens: int) -> tuple[int, list[int]]:
    """(steps, steps that accepted at least i + 1 drafts for each i) over `prompts`."""
    steps, per_position = 0, []
    for p in prompts:
        r = gen.generate_ids(gen.tokenizer.encode_prompt(p.prompt), max_new_tokens)
        steps += r.stats.steps
        for i, n in enumerate(r.stats.accepted_per_position):
            if i == len(per_position):
                per_position.append(0)
            per_position[i] += n
    return steps, per_position


def main() -> None:
    from chain_alpha import held_out_parser  # scripts/ is this script's first import path

    ap = held_out_parser(__doc__)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--write", type=Path, help="a head's folder: keep the numbers in its metrics.json")
    args = ap.parse_args()

    from specrt.cli.bench_cmd import prompt_set
    from specrt.runtime.generate import Generator

    prompts = prompt_set("heldout", args.per_category)
    common = dict(drafter=args.drafter, max_seq_len=1024, backend="native", threads=args.threads)
    chain = Generator(args.bundle, **common, tree_nodes=args.depth, beam=1)
    steps, per_position = accepted(chain, prompts, args.max_new_tokens)
    per_position += [0] * (args.depth - len(per_position))
    by_depth = [per_position[0] / steps] + [per_position[i] / max(per_position[i - 1], 1) for i in range(1, args.depth)]
    within = [by_depth[0]]
    for width in (2, 3):
        fan = Generator(args.bundle, **common, num_draft_tokens=1, fan=width)
        fan_steps, fan_accepted = accepted(fan, prompts, args.max_new_tokens)
        within.append(fan_accepted[0] / fan_steps if fan_accepted else 0.0)
    record = {"acceptance_by_depth": [round(a, 4) for a in by_depth], "acceptance_top_k": [round(a, 4) for a in within],
              "prompts": f"the shipped held-out prompts, {args.per_category} a category ({len(prompts)})",
              "steps": steps, "max_new_tokens": args.max_new_tokens, "bundle": str(args.bundle),
              "measured": datetime.date.today().isoformat(),
              "command": f"python scripts/runtime_acceptance.py BUNDLE --per-category {args.per_category} --write HEAD"}
    print(json.dumps(record))
    if args.write:
        path = args.write / "metrics.json"
        metrics = json.loads(path.read_text())
        metrics["run_time"] = record
        fd, tmp = tempfile.mkstemp(dir=args.write, prefix=".metrics.")
        with os.fdopen(fd, "w") as f:
            json.dump(metrics, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
