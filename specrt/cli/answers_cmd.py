"""`specrt answers`: a distillation store's answers as one small file, and the store rebuilt from it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from specrt.cli.options import stop_on_sigterm


@click.group("answers")
def command() -> None:
    """A distillation store's answers alone (~1 byte an answer token, small enough to keep in git), and the whole
    store rebuilt from them on the native kernels: what took hours of generation to write takes a prefill
    per answer to restore, on any machine."""


@command.command("save")
@click.argument("store", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path, dir_okay=False),
              help="The answers file to write (.npz; replaced whole).")
def save(store: Path, output: Path) -> None:
    """Write every answer of the store STORE (token ids, prompt lengths, splits, job ids, its key) to one file."""
    from specrt.export.training.answer_file import save_answers

    s = save_answers(store, output)
    click.echo(f"{output}: {s['sequences']:,} answers, {s['answer_tokens']:,} answer tokens, {s['rows']:,} rows in "
               f"{s['bytes'] / 1e6:.1f} MB")


@command.command("replay")
@click.argument("answers", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--target", required=True, type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="The int4 bundle whose target computes the features (the one that wrote the answers).")
@click.option("--store", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="The store to write or extend (a rerun skips the answers it holds).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: 2, or every core where there are fewer).")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Start no answer after this long (rerun to go on).")
def replay(answers: Path, target: Path, store: Path, threads: int | None, max_minutes: float | None) -> None:
    """Rebuild a distillation store from the answers file ANSWERS: every answer's hidden states, tapped states
    and top-k from TARGET's int4 target on the native kernels, bit for bit what specrt distill --backend native
    stored when that graph wrote them."""
    from specrt.errors import SpecrtError
    from specrt.export.training.answer_file import load_answers
    from specrt.export.training.replay import replay_answers

    if not (target / "manifest.json").is_file():
        raise SpecrtError(f"--target {target} is not an exported bundle (no manifest.json): pass the int4 bundle, "
                          "e.g. artifacts/bundles/smollm2-135m-instruct")
    stop_on_sigterm()  # a stopped replay keeps what finished (a rerun resumes)
    loaded = load_answers(answers)
    s = replay_answers(loaded, store, target, threads or min(os.cpu_count() or 1, 2), max_minutes=max_minutes)
    with (store / "runs.jsonl").open("a") as f:
        f.write(json.dumps({"replay": str(answers), **s}) + "\n")
    left = f"; {s['left']:,} left: rerun to go on" if s["left"] else ""
    click.echo(f"store {store}: {s['made']:,} answers replayed in {s['seconds']:.0f}s ({s['rows_per_second']:.0f} "
               f"rows/s), {s['sequences']:,} of {len(loaded):,} held{left}")
    if not s["same_graph"]:
        agree = s["greedy_argmax_is_stored_token"]
        share = "no greedy rows" if agree is None else f"{agree:.1%} of greedy rows"
        click.echo(f"note: another target graph wrote these answers; this one's argmax is the stored token at {share}, "
                   f"so the features are {target}'s own states for another graph's answers")
    click.echo(f"next: specrt train KIND --store {store}")
