"""`specrt bench-serve`: the HTTP server's throughput and latency, batched against batch-1 serving."""

from __future__ import annotations

import json

import click

from specrt.cli.options import bundle_argument, make_generator, runtime_options


@click.command("bench-serve")
@bundle_argument
@click.option("--concurrency", default="1,4,8", show_default=True, help="Comma-separated client concurrencies.")
@click.option("--requests", "n_requests", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--drafter", default=None, help="Drafter (default: the bundle's tuned choice, else plain).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="Also write the rows here.")
@runtime_options
def command(bundle, concurrency, n_requests, max_tokens, drafter, json_out, **runtime):
    """Serve BUNDLE on loopback and measure tokens/s and latency at each concurrency, batched verify passes
    (slots = concurrency) beside batch-1 serving of the same greedy chat requests, in one run."""
    from specrt.cli.bench_cmd import default_prompts
    from specrt.runtime.serving.loadgen import bench_serve, format_rows
    from specrt.tools.bench import load_prompts

    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{concurrency!r}: give positive integers such as 1,4,8", param_hint="--concurrency")
    gen = make_generator(bundle, drafter, slots=max(levels), **runtime)
    prompts = [p.prompt for p in load_prompts(default_prompts())]
    prompts = [prompts[i % len(prompts)] for i in range(n_requests)]
    rows = bench_serve(gen, prompts, max_tokens, levels)
    click.echo(f"drafter {gen.drafter_name}, {n_requests} requests × ≤{max_tokens} tokens, {gen.threads} threads")
    click.echo(format_rows(rows))
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"drafter": gen.drafter_name, "rows": rows}, f, indent=1)
