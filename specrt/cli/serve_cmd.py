"""`specrt serve`: an OpenAI-compatible HTTP server over a bundle, with batched speculative decoding."""

from __future__ import annotations

import click

from specrt.cli.options import bundle_argument, make_generator, resolve_bundle, runtime_options


@click.command("serve")
@bundle_argument
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8000, show_default=True)
@click.option("--drafter", default=None,
              help="Drafter every request uses (see `specrt generate`). Default: the bundle's tuned choice, else plain.")
@click.option("--slots", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="Sequences decoded together (KV slots; each verify pass serves all of them).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests queued for a slot; beyond that the server answers 503.")
@click.option("--model-name", default=None, help="The `model` clients name (default: the bundle folder's name).")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens when a request gives none (chat; completions default to 16 as OpenAI's).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True)
@runtime_options
def command(bundle, host, port, drafter, slots, max_waiting, model_name, default_max_tokens, log_level, **runtime):
    """Serve BUNDLE over HTTP: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
    /health and /metrics (Prometheus)."""
    import uvicorn

    from specrt.runtime.serving.api import create_app
    from specrt.runtime.serving.scheduler import Scheduler

    path = resolve_bundle(bundle)
    gen = make_generator(path, drafter, slots=slots, **runtime)
    scheduler = Scheduler(gen, max_waiting=max_waiting)
    name = model_name or path.name
    app = create_app(scheduler, name, default_max_tokens)
    for note in gen.notes:
        click.echo(note, err=True)
    click.echo(f"specrt serve: {name} ({gen.drafter_name}, {gen.slots} slots, context {gen.capacity}) on "
               f"http://{host}:{port}/v1; {gen.exactness.summary()}"
               + ("" if gen.lossless else " — responses are NOT guaranteed to equal plain decoding"), err=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
