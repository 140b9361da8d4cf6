"""`specrt serve-triton`: a real Triton Inference Server (the tritonserver nvidia-pytriton ships; CPU)
over a bundle or a `specrt export-triton` repository. The mechanics, and how the Python backend's stub
gets a working Python (numpy<2, specrt), are in deploy/triton/server.py."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from specrt.cli.options import resolve_bundle


@click.command("serve-triton")
@click.argument("source", required=False, type=click.Path(path_type=Path), default=None, metavar="[SOURCE]")
@click.option("--repo", type=click.Path(path_type=Path), default=None,
              help="Where a bundle's repository is written, replaced each time (default: $SPECRT_HOME/triton/"
                   "<bundle name>).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address HTTP, gRPC and metrics listen on.")
@click.option("--http-port", type=click.IntRange(min=1, max=65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(min=1, max=65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(min=1, max=65535), default=8002, show_default=True)
@click.option("--instances", type=click.IntRange(min=1), default=None,
              help="Instances (instance_group count) of each served model, each with its own KV cache. Default: "
                   "1 for a bundle; a repository keeps its own (given: its config.pbtxt is rewritten).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="A bundle's repository also gets specrt_generate_stream (decoupled: /generate_stream SSE, "
                   "gRPC streams; its instances hold their own Generators).")
@click.option("--drafter", default=None, help="Bundle only: the drafter served (default: the tuned one, else plain).")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="Bundle only: KV capacity. Default: min(2048, model maximum).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Bundle only: ONNX Runtime intra-op threads per instance (default 2).")
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1, max=16), default=None,
              help="Bundle only: chain length (default 5).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None,
              help="Bundle only: new tokens when a request sends no max_tokens (default 128).")
@click.option("--log-verbose", type=click.IntRange(min=0), default=0, show_default=True,
              help="tritonserver --log-verbose level (1: per-request scheduling).")
@click.option("--log-file", type=click.Path(path_type=Path), default=None,
              help="Append tritonserver's output here instead of this terminal.")
@click.option("--env-dir", type=click.Path(path_type=Path), default=None,
              help="The Python backend stub's environment (default: a cached one under specrt's cache folder).")
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds to wait for the server and its models to be READY.")
def command(source, repo, host, http_port, grpc_port, metrics_port, instances, stream, drafter, max_seq_len,
            threads, num_draft_tokens, max_tokens, log_verbose, log_file, env_dir, ready_timeout):
    """Serve SOURCE (a bundle, default the default bundle, or a `specrt export-triton` repository) on a real
    Triton Inference Server until Ctrl-C: specrt_generate (and specrt_generate_stream) over HTTP and gRPC."""
    from specrt.deploy.triton import server as triton
    from specrt.deploy.triton.repo import GENERATE_MODEL, STREAM_MODEL
    from specrt.errors import SpecrtError

    source = resolve_bundle(source)
    bundle_options = {"drafter": drafter, "max_seq_len": max_seq_len, "threads": threads,
                      "num_draft_tokens": num_draft_tokens, "max_tokens": max_tokens}
    is_bundle = (source / "manifest.json").is_file()
    if not is_bundle:
        _check_repo(source, repo, bundle_options)
    dist = triton.find_tritonserver()  # before anything is written
    if is_bundle:
        repo = _write_repo(source, repo, instances or 1, stream, bundle_options)
    else:
        repo = _existing_repo(source, instances)
    models = [m for m in (GENERATE_MODEL, STREAM_MODEL) if (repo / m / "config.pbtxt").is_file()]
    env = triton.build_stub_env(dist, env_dir, log=lambda line: click.echo(line, err=True))
    server = triton.TritonServer(repo, dist, env, models, host, http_port, grpc_port, metrics_port,
                                 log_verbose=log_verbose, log_file=log_file)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # kill, systemd, docker stop: stop tritonserver too
    try:
        with server:
            meta = server.wait_ready(ready_timeout)
            click.echo(f"specrt serve-triton: tritonserver {meta.get('version', '?')} (nvidia-pytriton "
                       f"{dist.version}) ready at {server.url}: {', '.join(models)} from {repo}")
            click.echo(f"  curl -s {server.url}/v2/models/{GENERATE_MODEL}/generate "
                       """-d '{"text_input": "What is speculative decoding?", "max_tokens": 64}'""", err=True)
            code = server.process.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if code != 0:
        raise SpecrtError(f"tritonserver exited with code {code}: {server.log_tail()}")


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through `with server:`, which stops it


def _write_repo(bundle: Path, repo: Path | None, instances: int, stream: bool, options: dict) -> Path:
    """The bundle's repository at `repo` (replaced: only an earlier specrt repository, never another folder)."""
    from specrt.deploy.triton.repo import GENERATE_MODEL, ServeSettings, write_triton_repo
    from specrt.errors import SpecrtError
    from specrt.paths import home

    repo = repo or home() / "triton" / bundle.resolve().name
    if repo.exists() and not (repo / GENERATE_MODEL / "config.pbtxt").is_file():
        raise SpecrtError(f"{repo} exists and is not a specrt Triton repository: choose another --repo")
    given = {k: v for k, v in options.items() if v is not None}
    settings = ServeSettings(**{"drafter": "", **given}, instances=instances, stream=stream)
    write_triton_repo(bundle, repo, settings, force=True)
    return repo


def _check_repo(source: Path, repo: Path | None, options: dict) -> None:
    from specrt.deploy.triton.repo import GENERATE_MODEL
    from specrt.errors import SpecrtError

    if not (source / GENERATE_MODEL / "config.pbtxt").is_file():
        raise SpecrtError(f"{source} is neither a bundle (manifest.json) nor a specrt Triton repository "
                          f"({GENERATE_MODEL}/config.pbtxt): export one with `specrt export` or `specrt export-triton`")
    given = [f"--{k.replace('_', '-')}" for k, v in options.items() if v is not None]
    if repo is not None or given:
        raise SpecrtError(f"{' '.join(given) or '--repo'} applies when SOURCE is a bundle; {source} is a repository "
                          "that keeps its config.pbtxt parameters (write it again with `specrt export-triton`)")


def _existing_repo(source: Path, instances: int | None) -> Path:
    """`source` as it is, but for the instance count when one is given."""
    from specrt.deploy.triton.repo import GENERATE_MODEL, STREAM_MODEL, set_instance_count

    if instances is not None:
        for model in (GENERATE_MODEL, STREAM_MODEL):
            if (source / model / "config.pbtxt").is_file():
                old = set_instance_count(source, model, instances)
                if old != instances:
                    click.echo(f"{source / model / 'config.pbtxt'}: instance_group count {old} -> {instances}",
                               err=True)
    return source
