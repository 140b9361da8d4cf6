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
@click.option("--mixed", type=click.IntRange(min=1), default=None,
              help="Instead: N mixed requests (chat and completions, streamed or not, 60% greedy, 1..--max-tokens "
                   "tokens) at the first --concurrency over --slots slots; every greedy response is checked "
                   "against single-request plain decoding; p50/p95 latency and RSS are reported.")
@click.option("--slots", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="KV slots of the --mixed server.")
@runtime_options
def command(bundle, concurrency, n_requests, max_tokens, drafter, json_out, mixed, slots, **runtime):
    """Serve BUNDLE on loopback and measure tokens/s and latency at each concurrency, batched verify passes
    (slots = concurrency) beside batch-1 serving of the same greedy chat requests, in one run; or, with
    --mixed, a mixed load held to plain decoding."""
    from specrt.cli.bench_cmd import default_prompts
    from specrt.runtime.serving.loadgen import bench_serve, format_rows
    from specrt.tools.bench import load_prompts

    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{concurrency!r}: give positive integers such as 1,4,8", param_hint="--concurrency")
    prompts = [p.prompt for p in load_prompts(default_prompts())]
    if mixed:
        return _mixed(bundle, drafter, prompts, mixed, levels[0], slots, max_tokens, json_out, runtime)
    gen = make_generator(bundle, drafter, slots=max(levels), **runtime)
    prompts = [prompts[i % len(prompts)] for i in range(n_requests)]
    rows = bench_serve(gen, prompts, max_tokens, levels)
    click.echo(f"drafter {gen.drafter_name}, {n_requests} requests × ≤{max_tokens} tokens, {gen.threads} threads")
    click.echo(format_rows(rows))
    if json_out:
        _write_json(json_out, {"drafter": gen.drafter_name, "rows": rows})


def _mixed(bundle, drafter, prompts, n, concurrency, slots, max_tokens, json_out, runtime):
    import dataclasses

    import numpy as np
    from tqdm import tqdm

    from specrt.runtime.serving.mixed_load import check, mixed_requests, plain_texts, serve_mixed

    gen = make_generator(bundle, drafter, slots=slots, **runtime)
    name = gen.drafter_name
    reqs = mixed_requests(n, prompts, max_tokens, np.random.default_rng(0))
    with tqdm(total=n, desc=f"{name}: {n} requests", unit="req") as bar:
        report, outcomes, scheduler = serve_mixed(gen, reqs, concurrency, slots, progress=bar)
    click.echo("plain single-request reference of every greedy request…", err=True)
    reference = plain_texts(gen.use("plain"), reqs)
    report = check(reqs, outcomes, reference, report)
    click.echo(f"drafter {name}, {slots} slots, {gen.threads} threads, mean batch "
               f"{np.mean(scheduler.batch_sizes):.2f}: {report.summary()}")
    for body, got, want in report.mismatches[:3]:
        click.echo(f"  MISMATCH {body}: {got!r} != plain {want!r}", err=True)
    if json_out:
        _write_json(json_out, {"drafter": name, "slots": slots, **dataclasses.asdict(report)})
    if report.errors or report.mismatches:
        raise SystemExit(1)


def _write_json(path: str, obj: dict) -> None:
    """Written whole or not at all (a temporary file beside it, then renamed)."""
    import os

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)
