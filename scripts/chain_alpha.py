"""How often a learned drafter's first draft is accepted, and what proposing it costs, at one fixed shape: the
drafter as a chain of one draft (`tree_nodes=1, beam=1`), so bundles that differ only in the drafter's weights
compare on the same steps.

    python scripts/chain_alpha.py BUNDLE [--drafter eagle3] [--per-category 3] [--max-new-tokens 128]

Runs the shipped held-out prompts (never trained on), greedy, native backend, in this process only (run each
bundle in its own process to compare time). Prints one JSON line: α at depth 1 (accepted drafts / steps; also by prompt category), the
propose and verify ms per step, tokens/s, and whether every answer equals plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import time


def held_out_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a script that runs a bundle's drafter over the shipped held-out prompts (this one's, and
    scripts/runtime_acceptance.py's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--drafter", default="eagle3")
    ap.add_argument("--per-category", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main() -> None:
    args = held_out_parser(__doc__).parse_args()

    from specrt.cli.bench_cmd import prompt_set
    from specrt.runtime.generate import Generator

    prompts = prompt_set("heldout", args.per_category)
    gen = Generator(args.bundle, drafter=args.drafter, max_seq_len=1024, backend="native", threads=args.threads,
                    tree_nodes=1, beam=1)
    plain = Generator(args.bundle, drafter="plain", max_seq_len=1024, backend="native", threads=args.threads)
    gen.generate_ids(gen.tokenizer.encode_prompt("Hello"), 8)  # warm
    steps = accepted = tokens = equal = 0
    by_category: dict[str, list[int]] = {}
    propose = verify = seconds = 0.0
    for p in prompts:
        ids = gen.tokenizer.encode_prompt(p.prompt)
        t0 = time.perf_counter()
        r = gen.generate_ids(ids, args.max_new_tokens)
        seconds += time.perf_counter() - t0
        steps, accepted, tokens = steps + r.stats.steps, accepted + r.stats.accepted, tokens + len(r.token_ids)
        cat = by_category.setdefault(p.category, [0, 0])
        cat[0], cat[1] = cat[0] + r.stats.accepted, cat[1] + r.stats.steps
        propose += r.stats.stage_seconds["propose"]
        verify += r.stats.stage_seconds["verify"]
        equal += r.token_ids == plain.generate_ids(ids, args.max_new_tokens).token_ids
    print(json.dumps({"bundle": args.bundle, "drafter": args.drafter, "prompts": len(prompts), "steps": steps,
                      "alpha1": round(accepted / steps, 4), "propose_ms_per_step": round(1e3 * propose / steps, 3),
                      "verify_ms_per_step": round(1e3 * verify / steps, 3), "tokens_per_s": round(tokens / seconds, 1),
                      "identical": f"{equal}/{len(prompts)}",
                      "alpha1_by_category": {c: round(a / max(n, 1), 3) for c, (a, n) in sorted(by_category.items())}}))


if __name__ == "__main__":
    main()
