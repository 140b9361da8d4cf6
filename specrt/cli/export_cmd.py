"""`specrt export`: a Hugging Face folder or GGUF (default: the embedded model) to an ONNX bundle."""

from __future__ import annotations

from pathlib import Path

import click

from specrt.cli.options import echo_exactness
from specrt.kinds import learned_kinds
from specrt.paths import default_bundle


def _drafter_specs(ctx, param, values) -> list[tuple[str, Path | None]]:
    """--drafter KIND or KIND=FOLDER -> (kind, folder or None); an unknown kind is refused by name."""
    out = []
    for value in values:
        kind, sep, folder = value.partition("=")
        if kind not in learned_kinds():
            raise click.BadParameter(f"{kind!r} is not a learned drafter kind: choose one of {', '.join(learned_kinds())}")
        if sep and not Path(folder).is_dir():
            raise click.BadParameter(f"{value}: {folder} is not a checkpoint folder")
        out.append((kind, Path(folder) if sep else None))
    return out


@click.command("export")
@click.option("--model", type=click.Path(path_type=Path), default=None,
              help="Hugging Face model folder or .gguf file. Default: the embedded SmolLM2-135M-Instruct.")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Bundle folder to write. Default: $SPECRT_HOME/bundles/smollm2-135m-instruct ($SPECRT_HOME: "
                   "default ./artifacts of the current directory; see specrt --help).")
@click.option("--draft-layers", type=click.IntRange(min=0), default=None,
              help="Export a layer-truncated copy of the target (its first N layers, N from 1 to its layers - 1) "
                   "as the draft model; 0: none. Default: 4, or the target's layers - 1 when it has fewer than 5.")
@click.option("--draft-model", type=click.Path(path_type=Path), default=None,
              help="Export this model (same tokenizer) as the draft instead of a truncated copy.")
@click.option("--drafter", "drafter_kinds", multiple=True, metavar="KIND[=FOLDER]", callback=_drafter_specs,
              help="Add a learned drafter (repeatable): KIND (" + ", ".join(learned_kinds()) + "), its weights from "
                   "FOLDER, else --drafter-weights, else `specrt train KIND`'s output ($SPECRT_HOME/drafters/KIND). "
                   "'draft' replaces the plain truncated copy by the fine-tuned one.")
@click.option("--drafter-weights", type=click.Path(path_type=Path), default=None,
              help="Checkpoint folder for the (single) --drafter: a specrt checkpoint or a public Medusa / "
                   "EAGLE / EAGLE-3 / MTP layout (safetensors, or .bin read with weights_only).")
@click.option("--quantize", type=click.Choice(["int4", "int8"]), default=None,
              help="Weight-only quantization of every graph for CPU (ONNX Runtime MatMulNBits, block 32, int8 "
                   "compute). The quantized target is the target: speculative output equals its own plain output.")
@click.option("--requantize", is_flag=True,
              help="With --quantize int4 on a GGUF: quantize its dequantized weights again (fitted int4) instead "
                   "of carrying its Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q4_K / Q6_K blocks as they are (the default: the model "
                   "file's own weights).")
@click.option("--int4-head", is_flag=True,
              help="With --quantize int4 on a GGUF: quantize the LM head to int4 while carrying the other blocks. A "
                   "one-row pass streams about 14 MB less (a Q8_0 head), at a quality cost docs/quality.md measures.")
@click.option("--drafter-quantize", type=click.Choice(["int4", "int8"]), default=None,
              help="With --quantize: the learned drafters' own weights at this precision instead (int8: the "
                   "layer's drafts closer to the trained head's, at twice its bytes). Default: as --quantize.")
@click.option("--no-parity-check", is_flag=True, help="Skip the ONNX Runtime vs PyTorch parity check.")
def command(model, output, draft_layers, draft_model, drafter_kinds, drafter_weights, quantize, requantize, int4_head,
            drafter_quantize, no_parity_check):
    """Export the target (and draft) decoder to ONNX with tokenizer and manifest."""
    from specrt.export.default_model import default_model_path
    from specrt.export.source_checks import check_folder_source, check_same_vocab, split_source

    model = model if model is not None else default_model_path()
    out = output if output is not None else default_bundle()
    if drafter_weights is not None and len(drafter_kinds) != 1:
        raise click.UsageError("--drafter-weights needs exactly one --drafter KIND")
    if requantize and (quantize != "int4" or Path(model).suffix.lower() != ".gguf"):
        raise click.UsageError("--requantize chooses how --quantize int4 treats a GGUF's blocks: it needs both")
    if int4_head and (quantize != "int4" or Path(model).suffix.lower() != ".gguf" or requantize):
        raise click.UsageError("--int4-head quantizes the head of a GGUF whose other blocks --quantize int4 carries: it "
                               "needs both, and not --requantize (which quantizes every weight)")
    if drafter_quantize and not quantize:
        raise click.UsageError("--drafter-quantize sets the learned drafters' precision within a quantized bundle: it "
                               "needs --quantize")
    for source in (model, draft_model):  # a wrong path is refused at once, not after torch has loaded
        if source is not None:
            split_source(Path(source))
    configs = [check_folder_source(Path(s)) if s is not None else None for s in (model, draft_model)]
    if draft_model is not None:
        check_same_vocab(*(c.get("vocab_size") if c else None for c in configs), Path(draft_model))
    from specrt.export.bundle import ExportOptions, export_bundle

    learned = tuple((k, folder or drafter_weights) for k, folder in dict(drafter_kinds).items())
    opts = ExportOptions(draft_layers="default" if draft_layers is None else draft_layers, draft_model=draft_model,
                         check_parity=not no_parity_check, drafters=learned,
                         quantize=quantize, requantize=requantize, int4_head=int4_head,
                         drafter_quantize=drafter_quantize)
    manifest = export_bundle(model, out, opts)
    checks = manifest.artifacts.get("parity_max_abs_logits", {})
    for role, g in manifest.graphs.items():
        worst = max(checks[role].values()) if role in checks else None
        note = f", parity max |Δlogits| {worst:.1e}" if worst is not None else ""
        click.echo(f"{role}: {g.file} ({g.config.num_layers} layers{note})")
    for kind, entry in manifest.drafters.items():
        worst = max(entry["parity_max_abs"].values(), default=None)
        note = f", parity max |Δ| {worst:.1e}" if worst is not None else ""
        click.echo(f"drafter {kind}: {', '.join(entry['graphs'])}{note}")
    q = manifest.artifacts.get("quantization")
    if q:
        click.echo(f"quantized {q['scheme']}: {sum(q['matmuls'].values())} MatMulNBits")
    for record in manifest.artifacts.get("exactness", {}).values():
        echo_exactness(record)
    click.echo(f"bundle written: {out}")
