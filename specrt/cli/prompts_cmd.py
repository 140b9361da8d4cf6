"""`specrt prompts`: the target writes prompts at scale (Magpie), de-duplicated and kept off every held-out set."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.options import heldout_options
from specrt.tools.magpie import SYSTEM_SETS


@click.command("prompts")
@click.argument("bundle", required=False, type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-o", "--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="JSONL file the prompts are appended to (a rerun resumes it; `specrt distill --prompts` reads it).")
@click.option("--count", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Prompts the file should hold.")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=96, show_default=True,
              help="Longest prompt written; one cut off at this length is dropped.")
@click.option("--threshold", type=click.FloatRange(min=0, max=1, min_open=True), default=0.7, show_default=True,
              help="Word 3-gram Jaccard similarity at which two prompts are near duplicates.")
@click.option("--slots", type=click.IntRange(min=1, max=64), default=8, show_default=True,
              help="Prompts written at once (batched on the serving scheduler).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Attempt i samples with seed SEED + i.")
@click.option("--systems", type=click.Choice(list(SYSTEM_SETS)), default="mixed", show_default=True,
              help="The system prompts attempts take in turn: every kind of request, or ones leaning toward "
                   "science questions or writing tasks (a file keeps the set it was started with).")
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@heldout_options
def command(bundle, out, count, max_new_tokens, heldout_files, threshold, heldout_share, slots, seed, systems, threads):
    """Write prompts with the bundle's own target (default: the default bundle): its chat template up to a user
    turn, sampled with varied system prompts, temperatures and seeds. A prompt that was cut off, is too short,
    repeats a kept one or any held-out prompt (exactly or nearly) is dropped."""
    from specrt.cli.options import resolve_bundle
    from specrt.runtime.generate import Generator
    from specrt.tools.magpie import Writer

    gen = Generator(resolve_bundle(bundle), "plain", threads=threads, slots=slots, max_seq_len=512)
    for note in gen.notes:
        click.echo(note, err=True)
    writer = Writer(gen, out, heldout_files, threshold, heldout_share, seed, systems)
    summary = writer.run(count, max_new_tokens, gen.slots)
    click.echo(json.dumps({"out": str(out), **summary}))
