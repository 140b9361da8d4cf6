"""`specrt validate`: checks of a bundle's graphs: --lossless (the statistical sampling check),
--polygraphy (the graphs' outputs vs the PyTorch reference saved at export, through Polygraphy) and
--quality (the target against the fp32 model of its source, teacher-forced: tools/quality.py)."""

from __future__ import annotations

import functools
import json

import click

from specrt.cli.options import UTF8, bundle_argument, resolve_bundle, verify_option
from specrt.errors import SpecrtError


@click.command("validate")
@bundle_argument
@click.option("--lossless", is_flag=True,
              help="Speculative sampling vs the exact target distribution (chi-square, α=1e-3) on this bundle.")
@click.option("--polygraphy", is_flag=True,
              help="Polygraphy: ONNX Runtime outputs vs the PyTorch reference saved at export (and TensorRT vs "
                   "ONNX Runtime where engines exist), held to bounds by precision (engines/trt/polygraphy_rules.py).")
@click.option("--quality", is_flag=True,
              help="The target vs the fp32 model of its source's values on held-out chat, teacher-forced: perplexity "
                   "ratio (≤ 1.02 passes) and top-1 agreement (≥ 0.95), KL (needs specrt[export]).")
@click.option("--quality-prompts", type=click.IntRange(min=1), default=10, show_default=True,
              help="--quality: held-out prompts scored.")
@click.option("--quality-tokens", type=click.IntRange(min=2), default=48, show_default=True,
              help="--quality: the reference's greedy answer tokens per prompt.")
@click.option("--kv-dtype", type=click.Choice(["auto", "fp32", "fp16", "int8"]), default=None,
              help="With --quality: the target's KV cache (as `specrt generate --kv-dtype`; default auto).")
@click.option("--drafter", default="ngram", show_default=True, help="Drafter to check: ngram, draft, ...")
@click.option("--tree", type=UTF8, default="default", show_default=True, help="Tree shape to check (chain, a name or FILE).")
@click.option("--samples", type=click.IntRange(min=50), default=1000, show_default=True)
@click.option("--length", type=click.IntRange(min=2, max=4), default=3, show_default=True,
              help="Tokens per sampled sequence.")
@click.option("--top-k", type=click.IntRange(min=2, max=8), default=4, show_default=True,
              help="Support per position (keeps the exact distribution enumerable).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@functools.partial(verify_option, help="First check every bundle file against the SHA-256 digests in manifest.json "
                   "(each one hashed again).")
def command(bundle, lossless, polygraphy, quality, quality_prompts, quality_tokens, kv_dtype, drafter, tree, samples,
            length, top_k, seed, threads, as_json, verify):
    """Validate BUNDLE; exits 0 only if every requested check passes."""
    if not (lossless or polygraphy or quality):
        raise SpecrtError("choose a check: --lossless, --polygraphy and/or --quality")
    if kv_dtype is not None and not quality:
        raise SpecrtError("--kv-dtype applies to --quality only: add --quality, or leave --kv-dtype out")
    if verify:  # before the checks: their verdicts say nothing about files that are not the exported ones
        from specrt.schema.integrity import verify_bundle
        from specrt.schema.manifest import Manifest

        path = resolve_bundle(bundle)
        verify_bundle(path, Manifest.load(path), full=True)
    reports = {}
    if polygraphy:
        reports["polygraphy"] = _polygraphy(resolve_bundle(bundle), threads, as_json)
    if lossless:
        reports["lossless"] = _lossless(bundle, drafter, tree, samples, length, top_k, seed, threads, as_json)
    if quality:
        reports["quality"] = _quality(resolve_bundle(bundle), quality_prompts, quality_tokens, threads, as_json,
                                      kv_dtype or "auto")
    if as_json:  # --lossless alone prints its report as before; with other checks, one object keyed by check
        click.echo(json.dumps(reports["lossless"] if set(reports) == {"lossless"} else reports))
    if any(r["verdict"] != "pass" for r in reports.values()):
        raise SystemExit(1)


def _polygraphy(bundle, threads, as_json) -> dict:
    from specrt.engines.trt.polygraphy_check import format_report, polygraphy_check

    report = polygraphy_check(bundle, threads=threads)
    if not as_json:
        for line in format_report(report):
            click.echo(line)
    return report


def _quality(bundle, prompts, tokens, threads, as_json, kv_dtype) -> dict:
    from specrt.tools.quality import quality_check

    r = quality_check(bundle, prompts, tokens, threads=threads, kv_dtype=kv_dtype)
    if not as_json:
        b = r["bounds"]
        click.echo(f"quality ({r['backend']}, {r['kv_dtype']} KV cache, {r['positions']} held-out positions vs {r['reference']} in fp32): "
                   f"perplexity {r['perplexity']:.3f} vs {r['reference_perplexity']:.3f} (ratio {r['ratio']:.4f}, bound "
                   f"{b['max_ratio']}), top-1 agreement {r['top1_agreement']:.3f} (bound {b['min_top1']}), KL "
                   f"{r['kl']:.4f} → {r['verdict']}")
    return r


def _lossless(bundle, drafter, tree, samples, length, top_k, seed, threads, as_json) -> dict:
    from specrt.tools.validate import lossless_check

    result, detail = lossless_check(resolve_bundle(bundle), drafter, tree, samples, length, top_k, seed=seed,
                                    threads=threads, progress=not as_json)
    report = {**result.to_dict(), **detail}
    if not detail["batch_invariant"]:  # speculation here is not plain decoding, whatever the statistic says
        report["verdict"] = "fail"
        if not as_json:
            click.echo(f"lossless: FAIL — {detail['batch_invariance_reason']}")
    if not as_json:
        click.echo(f"lossless ({detail['drafter']}, tree {detail['tree']}): chi-square {result.statistic:.2f} "
                   f"vs threshold {result.threshold:.2f} (dof {result.dof}, α={result.alpha}, {result.samples} samples, "
                   f"TV {result.total_variation:.3f}, {detail['accepted_drafts']} drafts accepted) → {result.verdict}")
    return report
