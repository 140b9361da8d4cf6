"""`specrt distill`: the target answers a prompt corpus at scale; its states go to a resumable store."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from specrt.cli.options import stop_on_sigterm


def _native_bundle(target: Path | None, features_from: Path | None) -> Path:
    """The bundle `--backend native` runs; the options that backend does not take are refused."""
    from click.core import ParameterSource

    from specrt.errors import SpecrtError

    ctx = click.get_current_context()
    for name in ("precision", "quant_engine"):
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            raise SpecrtError(f"--{name.replace('_', '-')} sets the torch backend's arithmetic; --backend native runs "
                              "the bundle's int4 target as the runtime does: drop it")
    if features_from is not None:
        raise SpecrtError("--features-from recomputes torch answers' features; --backend native stores the bundle's "
                          "own features as it answers: drop it")
    if target is None or not (target / "manifest.json").is_file():
        raise SpecrtError(f"--backend native runs an exported bundle's target: pass --target BUNDLE (a folder with "
                          f"manifest.json, e.g. artifacts/bundles/smollm2-135m-instruct){'' if target is None else f'; {target} is not one'}")
    return target


@click.command("distill")
@click.option("--target", type=click.Path(path_type=Path), default=None,
              help="Target model folder / .gguf, or a bundle exported from one. Default: the embedded model.")
@click.option("--prompts", type=click.Path(path_type=Path, exists=True, dir_okay=False), multiple=True,
              help='JSONL prompt corpus, one {"prompt": ..., "split": "train"|"heldout"} per line; repeat it to join '
                   "several (their ids must differ). Default: the shipped one.")
@click.option("--tokens", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Training answer tokens the store should hold (a rerun resumes or extends it).")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Start no answer after this long (answers in flight finish; rerun to go on).")
@click.option("--max-new-tokens", type=click.IntRange(min=8), default=192, show_default=True,
              help="Longest answer per prompt.")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True, max=2), default=0.8, show_default=True,
              help="Sampling temperature of the answers after the first (greedy) round over the prompts.")
@click.option("--precision", type=click.Choice(["int8", "fp32"]), default="int8", show_default=True,
              help="The target's linear layers while generating (int8: dynamic quantization, faster on CPUs).")
@click.option("--quant-engine", type=click.Choice(["auto", "x86", "fbgemm", "onednn", "qnnpack"]), default="auto",
              show_default=True, help="torch's int8 engine for --precision int8. auto: torch's choice for this CPU, "
                                      "unless SPECRT_QUANT_ENGINE names one. Recorded in the store's runs.jsonl.")
@click.option("--backend", type=click.Choice(["torch", "native"]), default="torch", show_default=True,
              help="Who answers. torch: the source model at --precision, then --features-from for the graph's "
                   "features. native: the --target bundle's int4 target on specrt's kernels, the model the runtime "
                   "verifies with; its states are the features (no second pass).")
@click.option("--slots", type=click.IntRange(min=1, max=512), default=64, show_default=True,
              help="Sequences generated at once.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads (default: every core; fewer when other work shares the machine).")
@click.option("--store", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Store folder. Default: one per target and settings under $SPECRT_HOME/train/cache.")
@click.option("--features-from", "features_from", type=click.Path(path_type=Path, exists=True, file_okay=False),
              default=None, help="A bundle: recompute every position's hidden states, tapped layers and top-k with "
                                 "its own target graph (the features the runtime gives a drafter) into --features-store.")
@click.option("--features-store", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Where --features-from writes (default: the store's folder name + '-graph').")
def command(target, prompts, tokens, max_minutes, max_new_tokens, temperature, precision, quant_engine, backend, slots,
            threads, store, features_from, features_store):
    """Build a distillation store: the target's answers to the corpus (held-out prompts once, greedy; training
    prompts in rounds, the first greedy, later ones sampled), with its hidden states (fp16) and top-k
    next-token distributions at every position, in memory-mapped shards that `specrt train --store` reads."""
    import torch

    from specrt.cli.train_cmd import _target_source
    from specrt.export.drafters.base import default_taps
    from specrt.export.loading import load_model
    from specrt.export.training.corpus import load_corpora
    from specrt.export.training.distill import build_store, default_store, store_key
    from specrt.paths import train_cache_dir

    bundle = _native_bundle(target, features_from) if backend == "native" else None
    if bundle is not None:
        precision = "native"
    if threads:
        torch.set_num_threads(threads)
    stop_on_sigterm()  # a stopped run keeps what finished (a rerun resumes)
    rows = load_corpora(prompts)
    loaded = load_model(_target_source(target), keep_hf=False)
    taps = tuple(default_taps(loaded.module.cfg.num_layers))
    root = store or default_store(train_cache_dir(), store_key(loaded, max_new_tokens, taps, temperature, precision))
    summary = build_store(loaded, rows, root, tokens, max_new_tokens, taps, temperature, precision, slots, max_minutes,
                          engine=quant_engine, bundle=bundle, threads=threads or min(os.cpu_count() or 1, 2))
    runs = root / "runs.jsonl"
    with runs.open("a") as f:
        f.write(json.dumps(summary) + "\n")
    rate = summary.get("tokens_per_second")
    click.echo(f"store {root}: {summary['answer_tokens']:,} answer tokens ({summary.get('made', 0):,} made in "
               f"{summary.get('seconds', 0):.0f}s{f', {rate:.0f} tok/s' if rate else ''})")
    if features_from is not None:
        from specrt.export.training.graph_features import featurize_store

        out = features_store or root.with_name(root.name + "-graph")
        feats = featurize_store(root, out, features_from, threads)
        with runs.open("a") as f:
            f.write(json.dumps({"features": feats}) + "\n")
        click.echo(f"features from {features_from}'s target graph: {out} ({feats['rows_per_second']:.0f} rows/s; the "
                   f"graph's argmax is the stored answer token at {feats['argmax_is_stored_next_token']:.1%} of rows)")
        root = out
    click.echo(f"next: specrt train KIND --store {root}")
