"""`specrt bench`: drafters side by side on the same prompts, in one process; peers each in their own."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import click

from specrt.cli.options import (
    EXEC_MODES,
    UTF8,
    available_drafters,
    bundle_argument,
    make_generator,
    resolve_bundle,
    runtime_options,
    sampling_options,
    sampling_params,
)


def default_prompts() -> Path:
    return Path(str(resources.files("specrt") / "data" / "bench_prompts.jsonl"))


def prompt_set(spec: str | None, per_category: int | None):
    """`--prompts`: a JSONL file, "heldout" (the training corpus's held-out prompts) or None (the default set)."""
    from specrt.tools.bench import load_prompts

    if spec == "heldout":
        return load_prompts(Path(str(resources.files("specrt") / "data" / "train_prompts.jsonl")), "heldout",
                            per_category)
    return load_prompts(Path(spec) if spec else default_prompts(), None, per_category)


@click.command("bench")
@bundle_argument
@click.option("--prompts", default=None,
              help="JSONL file, one {\"prompt\", \"category\"?, \"id\"?} per line; or 'heldout': the training "
                   "corpus's held-out prompts (never trained on). Default: specrt's mixed set.")
@click.option("--per-category", type=click.IntRange(min=1), default=None,
              help="Use only the first N prompts of each category.")
@click.option("--drafters", default=None,
              help="Comma-separated drafters; NAME+adaptive runs NAME with adaptive draft depth; auto: each request "
                   "the drafter whose measured pay-off is highest (rows record which). Default: every drafter the "
                   "bundle has.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--peers", "peer_names", default="",
              help="Other engines to run beside specrt on the same token ids, each family in its own process, "
                   "comma-separated: transformers (plain, prompt-lookup, assisted by the bundle's draft), llamacpp "
                   "(plain, prompt-lookup, on the source GGUF), ortgenai (onnxruntime-genai plain and prompt-lookup "
                   "on its int4 build of the source: `make peer-models`), vllm (vLLM's CPU engine, bf16: plain, ngram), "
                   "openvino (OpenVINO GenAI on its own int4 conversion: plain, prompt-lookup, a 4-layer draft), or "
                   "all. Needs pip install 'specrt[peers]'; vllm and openvino run in venvs of their own: "
                   "`make setup-peers`.")
@click.option("--baseline", type=click.Path(path_type=Path), default=None, metavar="BUNDLE",
              help="Also run plain decoding on this bundle (e.g. the fp32 export beside a quantized one) in the "
                   "same run, in its own process, as peer specrt-<quantization>-plain.")
@click.option("--exec-mode-baseline", "mode_baseline", type=click.Choice(list(EXEC_MODES)), default=None,
              help="Also run plain and every drafter in this execution mode (e.g. direct, unpadded) in the same "
                   "run, as peers specrt-MODE-DRAFTER: what the mode in use costs, and whether MODE is exact here.")
@click.option("--backend-baseline", "backend_baseline", type=click.Choice(["ort", "ort-fused"]), default=None,
              help="Also run plain and every drafter on this backend (e.g. ort-fused, attention fused into "
                   "GroupQueryAttention) in the same run, in its own process, as peers specrt-BACKEND-DRAFTER. "
                   "Another backend is another reference: its drafters are held to its own plain run, and where "
                   "its plain output differs from this backend's the table says \"different reference (d/n "
                   "differ)\".")
@click.option("--trees", type=UTF8, default=None,
              help="Comma-separated tree shapes to compare for every drafter (chain, default, wide, binary, FILE). "
                   "Default: just --tree.")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the results here.")
@click.option("--report", "report_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              metavar="DIR", help="Write a profile report here: report.md, report.json and PNG plots (time "
              "per stage, acceptance by draft depth, and the roofline against this machine's memory "
              "bandwidth, measured after the benchmark).")
@runtime_options
@sampling_options
def command(bundle, prompts, per_category, drafters, max_new_tokens, repeats, peer_names, baseline, mode_baseline,
            backend_baseline, trees, raw, json_out, report_dir, temperature, top_k, top_p, seed, **runtime):
    """Benchmark drafters on BUNDLE: tokens/s, speedup vs plain, τ, and output identity."""
    from specrt.tools.bench import format_table, run_bench
    from specrt.tools.peer_worker import close_peers
    from specrt.tools.peers import make_peers

    runtime["allow_inexact"] = True  # a benchmark runs what it is asked; identity with plain is reported
    if drafters:
        names = [d.strip() for d in drafters.split(",") if d.strip()]
    else:
        from specrt.schema.manifest import Manifest

        names = available_drafters(Manifest.load(resolve_bundle(bundle)))
    gen = make_generator(bundle, "plain", **runtime, fan_drafters=names)  # --fan is checked on the drafters run
    click.echo(f"exactness: {gen.exactness.summary()}", err=True)
    tree_list = [t.strip() for t in trees.split(",") if t.strip()] if trees else [None]
    sampling = sampling_params(temperature, top_k, top_p, seed if seed is not None else 0)
    peers = {}  # each family in its own worker process, ended when the run is done
    try:
        peers.update(make_peers(peer_names, gen.manifest, gen.threads, gen.capacity))
        if baseline is not None:
            from specrt.tools.peers import baseline_peer

            peers.update(baseline_peer(baseline, gen.threads, gen.capacity))
        if mode_baseline is not None:
            from specrt.tools.peers import exec_mode_peers

            peers.update(exec_mode_peers(gen.bundle, mode_baseline, names, gen.threads, gen.capacity))
        if backend_baseline is not None:
            from specrt.tools.peers import backend_peers

            peers.update(backend_peers(gen.bundle, backend_baseline, names, gen.threads, gen.capacity))
        result = run_bench(gen, prompt_set(prompts, per_category), names, max_new_tokens, repeats, peers, raw,
                           trees=tree_list, sampling=sampling)
    finally:
        close_peers(peers)
    result["config"]["exactness"] = gen.exactness.to_dict()
    click.echo(format_table(result["summary"]))
    click.echo("\nby category:")
    click.echo(format_table(result["by_category"]))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        tmp = json_out.with_name(json_out.name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(json_out)
        click.echo(f"results written: {json_out}")
    if report_dir:
        from specrt.tools.report import write_report
        from specrt.tools.roofline import build_roofline, measure_bandwidth, prompt_token_counts

        bandwidth = measure_bandwidth(threads=gen.threads)  # same run, after the benchmark
        lengths = prompt_token_counts(gen, prompt_set(prompts, per_category), raw)
        roofline = build_roofline(result, gen, bandwidth, lengths)
        click.echo(f"report written: {write_report(result, report_dir, roofline)}")
