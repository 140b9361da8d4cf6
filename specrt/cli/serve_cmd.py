"""`specrt serve`: an OpenAI-compatible HTTP server over a bundle, with batched speculative decoding."""

from __future__ import annotations

import click

from specrt.cli.options import bundle_argument, make_generator, resolve_bundle, runtime_options


@click.command("serve")
@bundle_argument
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True)
@click.option("--drafter", default=None,
              help="Drafter every request uses, or auto: each request's by measured pay-off (see `specrt generate`). "
                   "Default: the bundle's tuned choice, else plain.")
@click.option("--slots", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="Sequences decoded together (KV slots; each verify pass serves all of them).")
@click.option("--prefix-cache-mb", type=click.IntRange(min=0), default=None,
              help="Memory for the prefix cache: the KV rows of earlier prompts and answers, reused by requests that "
                   "start with the same tokens (a shared system prompt, the next turn of a chat); output is "
                   "unchanged. 0: off. Default: 256 where the backend keeps its KV cache in host memory (native, "
                   "ort), else off.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=None,
              help="Prompt rows a step runs (chunked prefill): the oldest prompt still prefilling takes this many "
                   "rows beside the decoding sequences' rows, so a long prompt delays the running streams by one "
                   "such chunk a step; larger prefills a prompt in fewer steps. Output is unchanged. Default: "
                   "the scheduler's (runtime/sequence.py PREFILL_CHUNK, 64).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued for a slot; beyond that the server answers 503.")
@click.option("--model-name", default=None, help="The `model` clients name (default: the bundle folder's name).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens when a request gives none (chat; completions default to 16 as OpenAI's).")
@click.option("--api-key", envvar="SPECRT_API_KEY", default=None, show_envvar=True,
              help="Clients must send `Authorization: Bearer KEY` to /v1/* (401 otherwise); /health and /metrics "
                   "stay open.")
@click.option("--allowed-hosts", default=None,
              help="Comma-separated Host names the server answers (400 otherwise). Default: loopback names when "
                   "bound to loopback (a DNS-rebinding defence), any name otherwise; '*' for any.")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 << 20, show_default=True,
              help="Larger request bodies are refused with 413 as they arrive.")
@click.option("--timeout", "read_timeout", type=click.FloatRange(min=0.1), default=30.0, show_default=True,
              help="Seconds a client has to send a request's head, and then its body (slow clients are dropped).")
@click.option("--max-connections", type=click.IntRange(min=1), default=512, show_default=True,
              help="Open connections at most; beyond that the server answers 503.")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@runtime_options
def command(bundle, host, port, drafter, slots, prefix_cache_mb, prefill_chunk, max_waiting, model_name, default_max_tokens, api_key, allowed_hosts,
            max_body_bytes, read_timeout, max_connections, log_level, **runtime):
    """Serve BUNDLE over HTTP: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
    /health and /metrics (Prometheus)."""
    from specrt.serving import require_http

    require_http("specrt serve")
    import uvicorn

    from specrt.serving.api import Limits, create_app
    from specrt.serving.guards import default_hosts
    from specrt.serving.http import uvicorn_config
    from specrt.serving.prefix_cache import cache_mb
    from specrt.serving.scheduler import Scheduler

    hosts = [h.strip() for h in allowed_hosts.split(",") if h.strip()] if allowed_hosts else default_hosts(host)
    limits = Limits(max_body_bytes, read_timeout, api_key or None, tuple(hosts))

    path = resolve_bundle(bundle)
    gen = make_generator(path, drafter, slots=slots, **runtime)
    prefix_mb = cache_mb(prefix_cache_mb, gen.model.host_kv)
    chunk = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
    scheduler = Scheduler(gen, max_waiting=max_waiting, prefix_cache_mb=prefix_mb, **chunk)
    name = model_name or path.name
    app = create_app(scheduler, name, default_max_tokens, limits)
    for note in gen.notes:
        click.echo(note, err=True)
    cache = f"prefix cache {prefix_mb} MB" if prefix_mb else "no prefix cache"
    click.echo(f"specrt serve: {name} ({gen.drafter_label}, {gen.slots} slots, context {gen.capacity}, {cache}) on "
               f"http://{host}:{port}/v1; {gen.exactness.summary()}"
               + ("" if gen.lossless else " — responses are NOT guaranteed to equal plain decoding")
               + ("" if api_key else "; no API key (--api-key / SPECRT_API_KEY)"), err=True)
    uvicorn.Server(uvicorn_config(app, host, port, limits, log_level, max_connections)).run()
