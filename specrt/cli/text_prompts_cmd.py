"""`specrt text-prompts`: requests about a given text (rewrite, summarise, simplify ...), built from passages."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.options import heldout_options


@click.command("text-prompts")
@click.option("-o", "--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="JSONL file to write (replaced whole; `specrt distill --prompts` reads it).")
@click.option("--from", "sources", multiple=True, required=True, type=click.Path(path_type=Path, exists=True),
              help="Where the passages come from (repeatable): a distillation store folder (its training answers, "
                   "decoded with the bundle's tokenizer) or a .txt / .md file.")
@click.option("--bundle", type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="The bundle whose tokenizer decodes a store's answers (default: the default bundle).")
@click.option("--count", type=click.IntRange(min=1), default=2000, show_default=True, help="Prompts to write.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which passages come first and which request each one gets.")
@heldout_options
def command(out, sources, bundle, count, heldout_files, heldout_share, seed):
    """Write requests about texts: each prose paragraph of 25-120 words becomes one request about it (simplify,
    summarise, make formal or casual, shorten, list, correct, retitle ...), de-duplicated and kept off every
    held-out set."""
    from specrt.tools.code_prompts import write
    from specrt.tools.text_prompts import passages, text_prompts

    tokenizer = None
    if any(Path(s).is_dir() for s in sources):
        from specrt.cli.options import resolve_bundle
        from specrt.runtime.tokenizer import Tokenizer
        from specrt.schema.manifest import Manifest

        root = resolve_bundle(bundle)
        tokenizer = Tokenizer(root, Manifest.load(root).tokenizer)
    rows, summary = text_prompts(passages(sources, tokenizer), count, seed, heldout_files, heldout_share=heldout_share)
    write(rows, out)
    click.echo(json.dumps({"out": str(out), **summary}))
