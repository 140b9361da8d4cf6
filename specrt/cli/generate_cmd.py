"""`specrt generate`: greedy generation with a drafter; streams text or prints one JSON object."""

from __future__ import annotations

import json
import sys

import click

from specrt.cli.options import (
    UTF8,
    bundle_argument,
    make_generator,
    runtime_options,
    sampling_options,
    sampling_params,
)
from specrt.kinds import runtime_drafters


@click.command("generate")
@bundle_argument
@click.option("--prompt", type=UTF8, required=True, help="The user prompt (chat-templated unless --raw).")
@click.option("--drafter", default=None,
              help=f"{', '.join(runtime_drafters())} (learned drafters: export them with "
                   "--drafter KIND), or auto: each request the drafter whose measured pay-off is highest, with "
                   "adaptive depth, else plain (--auto-candidates). Default: the bundle's tuned choice "
                   "(`specrt tune`), else plain.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--raw", is_flag=True, help="Do not apply the chat template; encode the prompt as is.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@runtime_options
@sampling_options
def command(bundle, prompt, drafter, max_new_tokens, raw, as_json, temperature, top_k, top_p, seed, **runtime):
    """Generate text from BUNDLE (default: the bundle `make export build` wrote)."""
    from specrt.runtime.generate import TextStream

    sampling = sampling_params(temperature, top_k, top_p, seed)
    gen = make_generator(bundle, drafter, **runtime)
    for note in gen.notes:
        click.echo(note, err=True)
    ids = gen.tokenizer.encode_prompt(prompt, raw)
    if as_json:
        result = gen.generate_ids(ids, max_new_tokens, sampling)
        text = gen.tokenizer.decode(result.token_ids)
        s = result.stats.to_dict()
        stats = {k: s[k] for k in ("new_tokens", "seconds", "tokens_per_s", "steps", "mean_accepted_len",
                                   "acceptance_rate")}
        stats["detail"] = {k: v for k, v in s.items() if k not in stats}
        click.echo(json.dumps({"text": text, "token_ids": result.token_ids, "drafter": result.drafter,
                               "finish_reason": result.finish_reason, "lossy": result.lossy,
                               "lossless": result.lossless, "exactness": exactness_summary(gen, result, sampling),
                               "stats": stats,
                               **({"auto": gen.last_pick.to_dict()} if gen.choice is not None else {}),
                               **({"shape": gen.drafter.chosen.to_dict()} if gen.drafter.chosen else {})}))
    else:
        stream = TextStream(gen, ids, max_new_tokens, sampling)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        result = stream.result
        st = result.stats
        click.echo("")
        click.echo(f"[{_label(gen, result)}] {st.new_tokens} tokens in {st.seconds:.2f}s ({st.tokens_per_s:.1f} tok/s), "
                   f"{st.steps} target passes, τ={st.mean_accepted_len:.2f}, finish={result.finish_reason}"
                   + (" [LOSSY: typical acceptance]" if result.lossy else "")
                   + (f" [NOT EXACT: {gen.exactness.reason}]" if not result.lossless and not result.lossy else ""),
                   err=True)


def _label(gen, result) -> str:
    """The drafter that ran; with --drafter auto, the one chosen and why."""
    if gen.requested_drafter == "auto" and gen.last_pick is not None:
        return f"auto: {result.drafter}, {gen.last_pick.reason}"
    return result.drafter


def exactness_summary(gen, result=None, sampling=None) -> dict:
    """What --json says about exactness: the mode, the verdict and why (no per-check detail), and
    `exact_to`, the reference the output equals (greedy) or follows (sampling): plain decoding of this
    target graph on this backend in this mode (runtime/reference.py); null where the output is not
    lossless (a lossy rule, or speculation where no mode is exact)."""
    e = gen.exactness
    lossless = gen.lossless if result is None else result.lossless
    greedy = sampling is None or sampling.greedy
    return {"mode": e.mode.name, "batch_invariant": e.lossless, "reason": e.reason, "source": e.source,
            "auto_mode": e.record["chosen"], "forced_by": e.forced_by, "requested_drafter": gen.requested_drafter,
            "exact_to": gen.reference.to_dict(greedy) if lossless else None,
            **({"native_kernel": gen.target.kernel_record} if getattr(gen.target, "kernel_record", None) else {}),
            **({"drafter_layers": layer.record} if (layer := _layer_of(gen.drafter)) is not None else {})}


def _layer_of(drafter):
    """The feature layer a learned drafter runs, or the draft model itself (its branch record says on which
    kernels), else None."""
    layer = getattr(drafter, "layer", None) or next(iter(getattr(drafter, "layers", []) or []), None) or drafter
    return layer if hasattr(layer, "record") else None
