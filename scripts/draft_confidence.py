"""How well a learned drafter's own confidence predicts acceptance: the drafter as a greedy chain of `--depth`
drafts over the shipped held-out prompts, each step's drafts with their confidence (the product of the chain's
top-1 draft probabilities, runtime/drafters/eagle.py) beside how many of them the target accepted.

    python scripts/draft_confidence.py BUNDLE [--depth 4] [--per-category 3] [--out steps.jsonl]

Prints one JSON line: acceptance by confidence bin at each depth, and for confidence floors the chain of
`--depth` cut where confidence falls below the floor: drafts per step, τ, and the speed-up over plain that the
bundle's verify cost curve (runtime/costs.py, measured here once) and the draft pass's share of a pass predict.
Steps come from runs at the full depth, so a floor's τ counts exactly the drafts it keeps (acceptance is a
prefix: a cut chain accepts min(accepted, kept)).
"""

from __future__ import annotations

import json

import numpy as np

BINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)
FLOORS = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7)


def main() -> None:
    from chain_alpha import held_out_parser

    ap = held_out_parser(__doc__)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--out", default=None, help="also write each step (confidences, accepted) as JSON lines")
    ap.add_argument("--curve", default=None, help="price the floors by this cost record (a machine cache's "
                    "costs/*.json) instead of measuring the curve here")
    args = ap.parse_args()

    from specrt.cli.bench_cmd import prompt_set
    from specrt.runtime.costs import CostCurve
    from specrt.runtime.generate import Generator
    from specrt.runtime.stats import Stats

    gen = Generator(args.bundle, drafter=args.drafter, max_seq_len=1024, backend="native", threads=args.threads,
                    tree_nodes=args.depth, beam=1, costs=None if args.curve else "auto")
    steps: list[tuple[list[float], int]] = []
    drafter = gen.drafter
    drafter.keep_confidence = True
    propose, record = drafter.propose, Stats.record
    held: list[list[float]] = []

    def watched_propose(*a, **k):
        prop = propose(*a, **k)
        held.append(list(prop.confidence or []))
        return prop

    def watched_record(self, drafted, accepted):
        record(self, drafted, accepted)
        if held:
            steps.append((held.pop(), accepted))

    drafter.propose = watched_propose
    Stats.record = watched_record
    for p in prompt_set("heldout", args.per_category):
        held.clear()
        gen.generate_ids(gen.tokenizer.encode_prompt(p.prompt), args.max_new_tokens)
    Stats.record = record

    curve = CostCurve.from_dict(json.load(open(args.curve))["curve"]) if args.curve else gen.cost_curve()
    report: dict = {"bundle": args.bundle, "depth": args.depth, "steps": len(steps)}
    by_depth = {}
    for d in range(args.depth):
        conf = np.array([c[d] for c, _ in steps if len(c) > d])
        ok = np.array([a > d for c, a in steps if len(c) > d])
        bins = np.digitize(conf, BINS) - 1
        by_depth[d + 1] = {f"{BINS[b]:.1f}": [int((bins == b).sum()), round(float(ok[bins == b].mean()), 3)]
                           for b in range(len(BINS) - 1) if (bins == b).any()}
    report["accepted_by_confidence"] = by_depth  # depth -> bin -> [steps, acceptance given the chain so far]
    if curve is not None:
        share = gen.drafter.pass_share(gen.manifest.target.config)
        rows = []
        for floor in FLOORS:
            kept = [sum(1 for x in c if x >= floor) for c, _ in steps]
            tau = np.mean([1 + min(a, k) for (_, a), k in zip(steps, kept, strict=True)])
            looks = [min(k + 1, args.depth) if k < args.depth else k for k in kept]  # draft passes run
            cost = np.mean([curve.ratio(1 + k) + n * share for k, n in zip(kept, looks, strict=True)])
            rows.append({"floor": floor, "drafts": round(float(np.mean(kept)), 3), "tau": round(float(tau), 3),
                         "speedup": round(float(tau / cost), 3)})
        report["floors"] = rows
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            for c, a in steps:
                f.write(json.dumps({"confidence": [round(x, 5) for x in c], "accepted": a}) + "\n")


if __name__ == "__main__":
    main()
