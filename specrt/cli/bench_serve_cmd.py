"""`specrt bench-serve`: the HTTP server's throughput and latency, batched against batch-1 serving; with
`--peer vllm`, `specrt serve` and another engine's OpenAI server under the same HTTP load (tools/serve_bench.py)."""

from __future__ import annotations

import click

from specrt.cli.options import bundle_argument, make_generator, runtime_options
from specrt.tools.serve_bench import SERVERS, write_json


@click.command("bench-serve")
@bundle_argument
@click.option("--concurrency", default=None, help="Comma-separated client concurrencies (default 1,4,8; with --peer "
              "1,4,16,32).")
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
@click.option("--peer", type=click.Choice(list(SERVERS)), default=None,
              help="Instead: this engine's own OpenAI server (vllm: `vllm serve` in its venv, `make setup-peers`), "
                   "then `specrt serve BUNDLE --slots MAX-CONCURRENCY`, one at a time, each under the same load "
                   "(chat, greedy, streamed and not) at every --concurrency: tok/s, p50/p95 latency, p50 TTFT, "
                   "errors, and greedy texts equal to the engine's own single request (specrt's also to "
                   "single-request plain decoding).")
@click.option("--process", is_flag=True, default=False,
              help="Instead: `specrt serve BUNDLE --slots MAX-CONCURRENCY` in a process of its own, the clients in "
                   "this one, as --peer runs it, without a peer.")
@click.option("--prompts", "prompts_spec", default=None,
              help="JSONL file, one {\"prompt\"} per line, or 'heldout' (the training corpus's held-out prompts): "
                   "request i sends prompt i (cycling when --requests is larger). Default: specrt's mixed set.")
@click.option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --peer or --process: requests arrive as a Poisson process of this many a second (seeded; "
                   "each server gets the same schedule), at most --concurrency in flight; the single-request "
                   "reference still sends them one by one.")
@click.option("--long-prompt", "long_tokens", type=click.IntRange(min=1), default=None, metavar="TOKENS",
              help="With --peer or --process: each streamed level of several users runs once more with one prompt of "
                   "about TOKENS tokens among its requests, arriving mid-run; its row gives the other requests' "
                   "TTFT and inter-token latency (and the long one's TTFT in --json). Give --max-seq-len room for it.")
@click.option("--prefix-cache-mb", type=click.IntRange(min=0), default=None,
              help="With --peer or --process: `specrt serve --prefix-cache-mb` (default: serve's). The reference and "
                   "every level send the same prompts, so with a cache each level after the first finds them "
                   "whole: 0 measures traffic of distinct prompts (or see scripts/serve_steps.py).")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="With --peer or --process: `specrt serve --prefill-chunk` (default: serve's).")
@runtime_options
def command(bundle, concurrency, n_requests, max_tokens, drafter, json_out, mixed, slots, peer, process, prompts_spec,
            rate, long_tokens, prefix_cache_mb, prefill_chunk, **runtime):
    """Serve BUNDLE on loopback and measure tokens/s and latency at each concurrency, batched verify passes
    (slots = concurrency) beside batch-1 serving of the same greedy chat requests, in one run; or, with
    --mixed, a mixed load held to plain decoding; or, with --peer, specrt's server against another's."""
    from specrt.serving import require_http

    require_http("specrt bench-serve")
    from specrt.cli.bench_cmd import prompt_set
    from specrt.tools.loadgen import bench_serve, format_rows

    concurrency = concurrency or ("1,4,16,32" if peer else "1,4,8")
    levels = [int(c) for c in concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{concurrency!r}: give positive integers such as 1,4,8", param_hint="--concurrency")
    served = {"--prefix-cache-mb": prefix_cache_mb, "--prefill-chunk": prefill_chunk}  # `specrt serve`'s own
    for flag, value in {"--rate": rate, "--long-prompt": long_tokens, **served}.items():
        if value is not None and not (peer or process):
            raise click.UsageError(f"{flag} needs --peer or --process (a server in its own process)")
    prompts = [p.prompt for p in prompt_set(prompts_spec, None)]
    if not prompts:
        raise click.BadParameter(f"{prompts_spec}: no prompts in it", param_hint="--prompts")
    if peer or process:
        serve_flags = [arg for flag, value in served.items() if value is not None for arg in (flag, str(value))]
        return _peer(bundle, peer, drafter, [prompts[i % len(prompts)] for i in range(n_requests)], max_tokens,
                     levels, json_out, runtime, rate, long_tokens, serve_flags)
    if mixed:
        return _mixed(bundle, drafter, prompts, mixed, levels[0], slots, max_tokens, json_out, runtime)
    gen = make_generator(bundle, drafter, slots=max(levels), **runtime)
    prompts = [prompts[i % len(prompts)] for i in range(n_requests)]
    rows = bench_serve(gen, prompts, max_tokens, levels)
    click.echo(f"drafter {gen.drafter_name}, {n_requests} requests × ≤{max_tokens} tokens, {gen.threads} threads")
    click.echo(format_rows(rows))
    if json_out:
        write_json(json_out, {"drafter": gen.drafter_name, "rows": rows})


def _mixed(bundle, drafter, prompts, n, concurrency, slots, max_tokens, json_out, runtime):
    import dataclasses

    import numpy as np
    from tqdm import tqdm

    from specrt.tools.mixed_load import check, mixed_requests, plain_texts, serve_mixed

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
        write_json(json_out, {"drafter": name, "slots": slots, **dataclasses.asdict(report)})
    if report.errors or report.mismatches:
        raise SystemExit(1)


def _peer(bundle, peer, drafter, prompts, max_tokens, levels, json_out, runtime, rate=None, long_tokens=None,
          serve_flags=()):
    """Each server alone, the same load on each (tools/serve_bench.py); the table, and --json."""
    from tqdm import tqdm

    from specrt.cli.options import resolve_bundle
    from specrt.tools.serve_bench import compare, format_table

    path = resolve_bundle(bundle)
    result = compare(path, peer, drafter, prompts, max_tokens, levels, runtime["threads"], runtime["max_seq_len"],
                     _runtime_flags(runtime) + list(serve_flags), log=lambda m: click.echo(m, err=True), bar=tqdm, rate=rate,
                     long_tokens=long_tokens)
    arriving = f"arriving at {rate:g}/s (Poisson), " if rate else ""
    click.echo(f"{len(prompts)} chat requests ({len(set(prompts))} distinct) × ≤{max_tokens} tokens, greedy, "
               f"{arriving}{runtime['threads']} threads; each server alone")
    click.echo(format_table(result["rows"]))
    if json_out:
        write_json(json_out, result)


def _runtime_flags(runtime: dict) -> list[str]:
    """The runtime options given to this command, as `specrt serve` flags (defaults left out, but the
    thread count always given: the peer runs on as many)."""
    flags: list[str] = ["--threads", str(runtime["threads"])]
    for p in command.params:
        if (not isinstance(p, click.Option) or p.name not in runtime or p.name == "threads"
                or runtime[p.name] == p.default):
            continue
        value = runtime[p.name]
        if p.is_flag and p.secondary_opts:  # --adaptive/--fixed-depth
            flags.append(p.opts[0] if value else p.secondary_opts[0])
        elif p.is_flag:
            flags += [p.opts[0]] if value else []
        elif value is not None:
            flags += [p.opts[0], str(value)]
    return flags
