"""`specrt validate`: checks of a bundle's graphs (today: --lossless, the statistical sampling check)."""

from __future__ import annotations

import json

import click

from specrt.cli.options import bundle_argument, resolve_bundle
from specrt.errors import SpecrtError


@click.command("validate")
@bundle_argument
@click.option("--lossless", is_flag=True,
              help="Speculative sampling vs the exact target distribution (chi-square, α=1e-3) on this bundle.")
@click.option("--drafter", default="ngram", show_default=True, help="Drafter to check: ngram, draft, ...")
@click.option("--tree", default="default", show_default=True, help="Tree shape to check (chain, a name or FILE).")
@click.option("--samples", type=click.IntRange(min=50), default=1000, show_default=True)
@click.option("--length", type=click.IntRange(min=2, max=4), default=3, show_default=True,
              help="Tokens per sampled sequence.")
@click.option("--top-k", type=click.IntRange(min=2, max=8), default=4, show_default=True,
              help="Support per position (keeps the exact distribution enumerable).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def command(bundle, lossless, drafter, tree, samples, length, top_k, seed, threads, as_json):
    """Validate BUNDLE; exits 0 only if every requested check passes."""
    from specrt.runtime.validate import lossless_check

    if not lossless:
        raise SpecrtError("choose a check: --lossless")
    result, detail = lossless_check(resolve_bundle(bundle), drafter, tree, samples, length, top_k, seed=seed,
                                    threads=threads, progress=not as_json)
    report = {**result.to_dict(), **detail}
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"lossless ({detail['drafter']}, tree {detail['tree']}): chi-square {result.statistic:.2f} "
                   f"vs threshold {result.threshold:.2f} (dof {result.dof}, α={result.alpha}, {result.samples} samples, "
                   f"TV {result.total_variation:.3f}, {detail['accepted_drafts']} drafts accepted) → {result.verdict}")
    if result.verdict != "pass":
        raise SystemExit(1)
