"""`specrt code-prompts`: requests about real code, cut from the Python sources on the machine."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.options import heldout_options


@click.command("code-prompts")
@click.option("-o", "--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="JSONL file to write (replaced whole; `specrt distill --prompts` reads it).")
@click.option("--count", type=click.IntRange(min=1), default=2000, show_default=True, help="Prompts to write.")
@click.option("--from", "roots", multiple=True, type=click.Path(path_type=Path, exists=True, file_okay=False),
              help="Folders of Python sources (repeatable). Default: this Python's standard library.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Which files come first and which request each function gets.")
@heldout_options
def command(out, count, roots, heldout_files, heldout_share, seed):
    """Write code prompts: each function of 4-40 lines in the sources becomes one request about it (explain,
    complete, document, test, simplify, find edge cases), de-duplicated and kept off every held-out set."""
    from specrt.tools.code_prompts import code_prompts, write

    rows, summary = code_prompts(count, roots, seed, heldout_files, heldout_share=heldout_share)
    write(rows, out)
    click.echo(json.dumps({"out": str(out), **summary}))
