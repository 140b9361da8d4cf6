"""`specrt tune`: measure drafter / tree / depth choices on your prompts; store the fastest in the bundle."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.options import available_drafters, bundle_argument, resolve_bundle


def spread(prompts: list, limit: int) -> list:
    """At most `limit` prompts, taken round-robin over their categories (file order within each)."""
    by_cat: dict[str, list] = {}
    for p in prompts:
        by_cat.setdefault(p.category, []).append(p)
    out, queues = [], list(by_cat.values())
    while len(out) < limit and any(queues):
        for q in queues:
            if q and len(out) < limit:
                out.append(q.pop(0))
    return out


@click.command("tune")
@bundle_argument
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="JSONL file, one {\"prompt\": ...} per line: a sample of your traffic. Default: specrt's mixed set.")
@click.option("--drafters", default=None, help="Comma-separated drafters to consider. Default: every one the bundle has.")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=96, show_default=True)
@click.option("--limit", type=click.IntRange(min=1), default=8, show_default=True,
              help="Use at most this many prompts of the file, spread over its categories.")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--dry-run", is_flag=True, help="Measure and print; do not write the choice into the manifest.")
def command(bundle, prompts_file, drafters, max_new_tokens, limit, threads, raw, dry_run):
    """Pick the fastest lossless configuration for BUNDLE and make it the default."""
    from specrt.cli.bench_cmd import default_prompts
    from specrt.runtime.generate import Generator
    from specrt.tools.bench import load_prompts
    from specrt.tools.tune import save_choice, tune

    path = resolve_bundle(bundle)
    prompts = spread(load_prompts(prompts_file or default_prompts()), limit)
    gen = Generator(path, "plain", threads=threads)  # the runtime's default capacity: min(2048, model maximum)
    names = [d.strip() for d in drafters.split(",") if d.strip()] if drafters else available_drafters(gen.manifest)
    encoded = [gen.tokenizer.encode_prompt(p.prompt, raw) for p in prompts]
    result = tune(gen, encoded, names, max_new_tokens)
    click.echo(f"{'configuration':<34} {'tok/s':>8} {'plain':>8} {'× plain':>8} {'τ':>6}  identical")
    for r in sorted(result["rows"], key=lambda r: -r["speedup_vs_plain"]):
        click.echo(f"{r['label']:<34} {r['tokens_per_s']:>8.1f} {r['plain_tokens_per_s']:>8.1f} "
                   f"{r['speedup_vs_plain']:>8.2f} {r['mean_accepted_len']:>6.2f}  {r['identical']}")
    best = result["best"]
    click.echo(f"best: {best['label']} ({best['speedup_vs_plain']:.2f}× plain)")
    if not dry_run:
        save_choice(path, result, len(prompts), max_new_tokens, threads)
        click.echo(f"written to {path / 'manifest.json'} (runtime_defaults): `specrt generate` without "
                   "--drafter now uses it")
