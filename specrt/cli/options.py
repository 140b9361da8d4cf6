"""Option bundles shared by several commands."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.paths import default_bundle


def bundle_argument(f):
    return click.argument("bundle", required=False, type=click.Path(path_type=Path),
                          default=None, metavar="[BUNDLE]")(f)


def resolve_bundle(bundle: Path | None) -> Path:
    return bundle if bundle is not None else default_bundle()


def runtime_options(f):
    """Settings of the runtime that generation and benchmarking share."""
    for opt in reversed([
        click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
                     help="KV capacity in tokens (prompt + output). Default: min(2048, model maximum)."),
        click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
                     help="ONNX Runtime intra-op threads."),
        click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1, max=16), default=5, show_default=True,
                     help="Tokens drafted per step (chain length)."),
        click.option("--ngram-max", type=click.IntRange(min=1), default=3, show_default=True,
                     help="ngram drafter: longest suffix to match."),
        click.option("--ngram-min", type=click.IntRange(min=1), default=1, show_default=True,
                     help="ngram drafter: shortest suffix to match."),
    ]):
        f = opt(f)
    return f


def generator_kwargs(max_seq_len, threads, num_draft_tokens, ngram_max, ngram_min) -> dict:
    return {"max_seq_len": max_seq_len, "threads": threads, "num_draft_tokens": num_draft_tokens,
            "ngram_max": ngram_max, "ngram_min": ngram_min}
