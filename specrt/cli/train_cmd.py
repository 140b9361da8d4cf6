"""`specrt train KIND`: self-distill a drafter for a target (default: the embedded model)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.options import stop_on_sigterm
from specrt.kinds import learned_kinds


def _target_source(target: Path | None) -> Path:
    """A model path from --target: a model folder / GGUF, or a bundle (its manifest names the source)."""
    from specrt.errors import SpecrtError
    from specrt.export.default_model import default_model_path
    from specrt.schema.manifest import MANIFEST, Manifest

    if target is None:
        return default_model_path()
    if (target / MANIFEST).is_file():
        source = Path(Manifest.load(target).target.source)
        if not source.exists():
            raise SpecrtError(f"bundle {target} was exported from {source}, which no longer exists: "
                              "pass the model folder or .gguf with --target")
        return source
    return target


@click.command("train")
@click.argument("kind", type=click.Choice(learned_kinds()))
@click.option("--target", type=click.Path(path_type=Path), default=None,
              help="Target model folder / .gguf, or a bundle exported from one. Default: the embedded model.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Checkpoint folder. Default: $SPECRT_HOME/drafters/KIND (where export looks).")
@click.option("--epochs", type=click.FloatRange(min=0), default=None,
              help="Passes over the training prompts' answers (default per kind, see README). 0 with --init: no "
                   "step; the warm start saved over this data's draft vocabulary (--draft-vocab) and evaluated.")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=20.0, show_default=True,
              help="Stop early after this long (the run is then marked as cut).")
@click.option("--steps", type=click.IntRange(min=1, max=8), default=None,
              help="Unrolled draft steps in training (eagle, eagle3: training-time test; mtp: draft steps).")
@click.option("--loss-rows", type=click.Choice(["all", "answer"]), default="all", show_default=True,
              help="eagle, eagle3, mtp: the rows the loss scores. answer: only the answers' (the rows drafted at run "
                   "time; SpecForge's loss mask), not the prompts'.")
@click.option("--step-decay", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True,
              help="eagle, eagle3, mtp: unrolled step s's loss weighs this to the power s-1 (SpecForge: 0.8).")
@click.option("--label-temperature", type=click.FloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True,
              help="The target's soft labels sharpened to p^(1/T) before the loss: below 1 moves their mass toward the "
                   "target's argmax, the token a greedy verify accepts (1: the distribution as distilled).")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=None, help="Peak learning rate.")
@click.option("--batch", "batch_seqs", type=click.IntRange(min=1), default=4, show_default=True,
              help="Sequences per optimizer step.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--prompts", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help='JSONL prompt corpus, one {"prompt": ..., "split": "train"|"heldout"} per line. Default: the shipped one.')
@click.option("--max-prompts", type=click.IntRange(min=2), default=None, help="Use only the first N prompts.")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=160, show_default=True,
              help="Length of the target's answers used as training data.")
@click.option("--store", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Train on a distillation store built by `specrt distill` (default: answer the prompts here). "
                   "Epochs then default to 1.")
@click.option("--set", "settings", multiple=True, metavar="KEY=VALUE",
              help="Drafter config field, e.g. --set num_heads=5 (medusa), --set num_modules=3 (mtp).")
@click.option("--precision", type=click.Choice(["auto", "bf16", "fp32"]), default="auto", show_default=True,
              help="Compute precision: bf16 autocast (fp32 weights) or fp32. auto: bf16 where the CPU computes "
                   "bf16 natively, else fp32, unless SPECRT_TRAIN_PRECISION names one. Recorded in metrics.json.")
@click.option("--draft-vocab", type=click.IntRange(min=16), default=8192, show_default=True,
              help="Draft vocabulary: the N most frequent target top-1 tokens of the data (metrics.json records the "
                   "coverage of 1k..32k). EAGLE-3 and block heads cover only these; the other kinds score over them.")
@click.option("--save-dtype", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="The checkpoint's weights (fp16: half the size, for a drafter to commit or ship).")
@click.option("--init", "init", type=click.Path(path_type=Path, exists=True, file_okay=False), default=None,
              help="Warm start: a checkpoint of the same kind (e.g. the shipped head); every weight but its draft "
                   "vocabulary, which the data decides.")
@click.option("--resume", is_flag=True,
              help="Go on with the run saved in OUTPUT.train-state (written every --checkpoint-minutes and when a "
                   "run stops); the store may have grown since.")
@click.option("--checkpoint-minutes", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Save the drafter, metrics.json and the run's state this often.")
def command(kind, target, output, epochs, max_minutes, steps, loss_rows, step_decay, label_temperature, lr, batch_seqs, seed, prompts, max_prompts,
            max_new_tokens, settings, store, precision, draft_vocab, save_dtype, init, resume, checkpoint_minutes):
    """Train a KIND drafter by self-distillation: the target answers a prompt corpus, its hidden states are
    cached once, and the drafter learns to predict the target's own next-token distributions."""
    from specrt import kinds
    from specrt.errors import SpecrtError
    from specrt.export.loading import load_model
    from specrt.export.training.corpus import load_prompts
    from specrt.export.training.loop import TrainSettings, train_from_prompts
    from specrt.paths import drafter_dir, train_cache_dir

    options = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise SpecrtError(f"--set {item!r}: write KEY=VALUE, e.g. --set num_heads=5")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    if store and max_prompts:
        raise click.UsageError("--max-prompts limits the prompts answered here; a --store holds its own answers: "
                               "drop one of the two")
    data = None
    if store:  # checked before the model loads: a damaged store is refused at once
        from specrt.export.training.store import MappedData

        data = MappedData(store)
    rows = load_prompts(path=prompts)
    if max_prompts:
        train_rows = [r for r in rows if r["split"] == "train"]
        held = [r for r in rows if r["split"] == "heldout"]
        n_held = max(1, max_prompts // 6)
        rows = train_rows[: max_prompts - n_held] + held[:n_held]
    out = output or drafter_dir(kind)
    loaded = load_model(_target_source(target), keep_hf=False)
    default_epochs = 1.0 if store else kinds.kind(kind).training.epochs
    s = TrainSettings(kind=kind, epochs=default_epochs if epochs is None else epochs, max_minutes=max_minutes,
                      batch_seqs=batch_seqs, lr=lr, steps=steps, seed=seed, max_new_tokens=max_new_tokens,
                      max_prompts=max_prompts, precision=precision, options=options, draft_vocab=draft_vocab,
                      save_dtype=save_dtype, init=str(init) if init else None, resume=resume,
                      checkpoint_minutes=checkpoint_minutes, loss_rows=loss_rows, step_decay=step_decay,
                      label_temperature=label_temperature)
    stop_on_sigterm()  # a stopped run saves its state (--resume goes on)
    if data is not None:
        from specrt.export.training.loop import train

        metrics = train(loaded.module, s, out, data)
    else:
        metrics = train_from_prompts(loaded, s, out, train_cache_dir(), rows)
    click.echo(summary(kind, metrics))
    click.echo(f"checkpoint written: {out}  (next: specrt export --drafter {kind})")


def summary(kind: str, metrics: dict) -> str:
    """The run's line: steps, how it ended, and its last held-out evaluation (a run stopped before its first
    has none yet)."""
    final = metrics["final"]
    ended = (f"{' (cut by --max-minutes)' if metrics['cut_by_max_minutes'] else ''}"
             f"{' (stopped; --resume goes on)' if metrics.get('interrupted') else ''}")
    if not final:
        return f"{kind}: {metrics['steps_done']} steps{ended}; no held-out evaluation yet"
    return (f"{kind}: {metrics['steps_done']} steps in {final['seconds']:.0f}s{ended}; held-out top-1 per step "
            f"{final['top1_per_step']}, τ estimate {final['tau_est']}")
