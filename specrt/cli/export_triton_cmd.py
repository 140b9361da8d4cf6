"""`specrt export-triton`: a Triton Inference Server model repository from a bundle."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("export-triton")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--drafter", default="", help="Drafter the served model runs (default: the bundle's `specrt tune` "
              "choice, else plain).")
@click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
              help="KV capacity of the served model. Default: min(2048, model maximum).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
              help="ONNX Runtime intra-op threads per model instance.")
@click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1, max=16), default=5, show_default=True,
              help="Chain length of the served model.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True,
              help="New tokens when a request sends no max_tokens.")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Model instances of specrt_generate (each holds its own KV cache).")
def command(bundle, out, force, drafter, max_seq_len, threads, num_draft_tokens, max_tokens, instances):
    """Write a Triton model repository for BUNDLE at OUT (graph models + a Python-backend generate model)."""
    from specrt.deploy.triton.repo import ServeSettings, write_triton_repo

    settings = ServeSettings(drafter=drafter, max_seq_len=max_seq_len, threads=threads,
                             num_draft_tokens=num_draft_tokens, max_tokens=max_tokens, instances=instances)
    models = write_triton_repo(bundle, out, settings, force=force)
    for name in models:
        click.echo(f"triton: {out / name}")
    click.echo(f"launch: tritonserver --model-repository {out.resolve()}")
