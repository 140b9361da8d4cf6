"""Option bundles shared by several commands."""

from __future__ import annotations

import math
from pathlib import Path

import click

from specrt.engines.registry import BACKENDS
from specrt.paths import existing_default_bundle
from specrt.runtime.exec_modes import MODES as EXEC_MODES


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that refuses nan and ±inf too (FloatRange lets nan through: it compares false)."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{rv} is not a finite number", param, ctx)
        return rv


class Utf8Text(click.ParamType):
    """Text that must be valid UTF-8 (undecodable bytes in argv reach Python as lone surrogates)."""

    name = "text"

    def convert(self, value, param, ctx):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            self.fail(f"{value!r} is not valid UTF-8: pass UTF-8 text", param, ctx)
        return value


UTF8 = Utf8Text()


VERIFY_HELP = ("Re-hash every bundle file against the SHA-256 digests in manifest.json (default: only files "
               "changed since they were last verified here).")


def verify_option(f, help: str = VERIFY_HELP):
    """--verify: hash every bundle file against manifest.json again (by default loading re-hashes only the
    files whose size or modification time changed since they were last hashed on this machine)."""
    return click.option("--verify", is_flag=True, help=help)(f)


def bundle_argument(f):
    return click.argument("bundle", required=False, type=click.Path(path_type=Path),
                          default=None, metavar="[BUNDLE]")(f)


def resolve_bundle(bundle: Path | None) -> Path:
    """BUNDLE as given, else the default bundle (refused, saying where specrt looked, when it is not there)."""
    return bundle if bundle is not None else existing_default_bundle()


def _apply(f, options):
    for opt in reversed(options):
        f = opt(f)
    return f


def runtime_options(f):
    """Settings of the runtime that generation and benchmarking share."""
    return _apply(f, [
        click.option("--max-seq-len", type=click.IntRange(min=2), default=None,
                     help="KV capacity in tokens (prompt + output). Default: min(2048, model maximum)."),
        click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True,
                     help="ONNX Runtime intra-op threads."),
        click.option("--backend", type=click.Choice(["auto", *BACKENDS]), default="auto",
                     show_default=True, help="The target's backend: auto (native for an int4 Llama-family bundle on a "
                     "CPU with AVX2, else ort), native (specrt's own batch-invariant int4 kernels, compiled on first "
                     "use), ort (ONNX Runtime, CPU), ort-fused (ONNX Runtime, "
                     "CPU, attention fused into GroupQueryAttention by `specrt build`: faster; it verifies chains "
                     "only, so a tree draft is cut to its top-ranked path), ort-cuda (ONNX Runtime's CUDA provider, "
                     "onnxruntime-gpu), trt (TensorRT engines from `specrt build --backend trt`), ort-device (the "
                     "device path on the CPU, for tests). Drafters run on ONNX Runtime, CPU; under native, "
                     "EAGLE, EAGLE-3 and MTP layers, Medusa heads and the draft model run on its kernels "
                     "(SPECRT_DRAFTER_LAYERS)."),
        click.option("--kv-dtype", type=click.Choice(["auto", "fp32", "fp16", "int8"]), default="auto",
                     show_default=True,
                     help="The target's KV cache: fp16 halves the bytes attention reads per pass and the memory "
                     "per sequence (each key and value rounded to the nearest half as it is written; speculative "
                     "output still equals plain output bitwise). int8: blocks of 32 codes and a scale, 0.56 of "
                     "fp16's bytes, for many users or long contexts; coarser, so it changes the model's output "
                     "slightly (speculation stays exact against plain on it). auto: fp16 on the native backend, "
                     "else fp32; fp16 and int8 run on native only."),
        click.option("--num-draft-tokens", "-k", type=click.IntRange(min=1, max=16), default=None,
                     help="Chain length when no --tree is given (default 5; the deepest draft with --adaptive)."),
        click.option("--adaptive/--fixed-depth", default=None,
                     help="Adaptive: choose the draft depth every step from the running acceptance and measured "
                          "costs, falling back to plain decoding while speculation does not pay. Default: fixed."),
        click.option("--tree", type=UTF8, default=None,
                     help="Draft tree: 'chain' (default, k drafts), a name (default, wide, binary) or a JSON "
                          "file holding a list of paths such as [[0],[1],[0,0]]."),
        click.option("--acceptance", type=click.Choice(["auto", "greedy", "rejection", "typical"]), default="auto",
                     show_default=True, help="auto: greedy at temperature 0, else rejection sampling (both "
                     "lossless). typical: Medusa typical acceptance — LOSSY, output no longer follows the target."),
        click.option("--auto-candidates", default=None, metavar="NAME,NAME,...",
                     help="--drafter auto: the drafters it chooses among per request (default: every drafter the "
                          "bundle has); plain decoding is always the fallback."),
        click.option("--ngram-max", type=click.IntRange(min=1), default=3, show_default=True,
                     help="ngram drafter: longest suffix to match."),
        click.option("--ngram-min", type=click.IntRange(min=1), default=1, show_default=True,
                     help="ngram drafter: shortest suffix to match."),
        click.option("--suffix-store", type=click.IntRange(min=0), default=None,
                     help="suffix drafter: tokens of earlier sequences (prompts and outputs) kept to draft from, "
                          "oldest evicted first; about 16 bytes each (default 65536; 0: this sequence only)."),
        click.option("--suffix-min-prob", type=FiniteFloatRange(min=0, max=1), default=None,
                     help="suffix drafter: the least path probability (its continuation counts) a drafted node "
                          "may have (default 0.1)."),
        click.option("--suffix-threshold", type=FiniteFloatRange(min=0), default=None,
                     help="eagle3-suffix: draft a step from the suffix tree where it expects at least this many "
                          "tokens accepted (its score times this sequence's record of suffix drafts), else from the "
                          "head. Default: priced on this machine's verify costs against the head's predicted "
                          "speed-up, the suffix draft cut to the nodes that pay for their rows."),
        click.option("--tree-nodes", type=click.IntRange(min=1, max=64), default=None,
                     help="eagle2/eagle3 dynamic tree: drafted nodes kept per step (default, with no --beam "
                          "either: a chain sized to this machine's verify costs and the head's acceptance)."),
        click.option("--beam", type=click.IntRange(min=1, max=16), default=None,
                     help="eagle2/eagle3 dynamic tree: nodes expanded per depth, children per node (default 4 "
                          "where --tree-nodes is given; with neither, a chain sized to this machine)."),
        click.option("--fan", type=click.IntRange(min=1, max=16), default=None,
                     help="eagle2/eagle3 (and eagle3-suffix): draft the first step's N best candidates side by side "
                          "and a chain of -k below the best (1: a chain). Default, with no --beam or --tree-nodes: "
                          "the fan and chain priced best on this machine's verify costs."),
        click.option("--exec-mode", type=click.Choice(["auto", *EXEC_MODES]), default="auto", show_default=True,
                     help="How target passes are shaped: auto picks the cheapest mode measured batch-invariant on "
                          "this machine (direct: as asked; padN: every pass at least N rows)."),
        click.option("--allow-inexact", is_flag=True,
                     help="Where no mode is batch-invariant here, speculate and batch anyway (output may differ "
                          "from plain decoding; reported as lossless: false). Default: fall back to plain decoding."),
        verify_option,
    ])


def heldout_options(f):
    """What keeps written prompts off held-out sets: the prompt commands (`prompts`, `code-prompts`,
    `text-prompts`) share these."""
    return _apply(f, [
        click.option("--heldout", "heldout_files", multiple=True,
                     type=click.Path(path_type=Path, exists=True, dir_okay=False),
                     help="More JSONL prompt files no written prompt may repeat or nearly repeat (the shipped "
                          "held-out split and benchmark set always count)."),
        click.option("--heldout-share", type=click.FloatRange(min=0, max=1), default=0.02, show_default=True,
                     help="Share of written prompts put in a held-out split of their own (by a hash of the text)."),
    ])


def sampling_options(f):
    return _apply(f, [
        click.option("--temperature", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
                     help="0: greedy. Applied identically to target and draft distributions."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off."),
        click.option("--top-p", type=FiniteFloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True,
                     help="1: off."),
        click.option("--seed", type=click.IntRange(min=0), default=None, help="Same seed, same output."),
    ])


TUNABLE = ("num_draft_tokens", "tree", "adaptive", "tree_nodes", "beam", "fan")
FANNED = ("eagle2", "eagle3", "eagle3-suffix")  # the drafters `--fan` shapes (runtime/drafters/eagle.py)


def make_generator(bundle: Path | None, drafter: str | None, max_seq_len, threads, num_draft_tokens, tree,
                   acceptance, ngram_max, ngram_min, tree_nodes=None, beam=None, adaptive=None, slots=1,
                   backend="auto", exec_mode="auto", allow_inexact=False, verify=False, auto_candidates=None,
                   suffix_store=None, suffix_min_prob=None, kv_dtype="auto", suffix_threshold=None, fan=None,
                   fan_drafters=None):
    """The Generator for a command's BUNDLE argument and `runtime_options`. With no drafter named, the
    bundle's tuned configuration (`specrt tune`) fills every option not given, else plain decoding.
    `auto_candidates`: comma-separated drafters `--drafter auto` chooses among. `fan_drafters`: the drafters
    that will run (a benchmark's list; default the one named), of which `fan` must shape one."""
    from specrt.runtime.generate import Generator
    from specrt.schema.manifest import Manifest

    path = resolve_bundle(bundle)
    given = {"num_draft_tokens": num_draft_tokens, "tree": tree, "adaptive": adaptive, "tree_nodes": tree_nodes,
             "beam": beam, "fan": fan}
    if drafter is None:
        tuned = Manifest.load(path).runtime_defaults
        drafter = tuned.get("drafter", "plain")
        given = {k: v if v is not None else tuned.get(k) for k, v in given.items()}
    check_fan(given["fan"], [drafter] if fan_drafters is None else fan_drafters)
    return Generator(path, drafter=drafter, max_seq_len=max_seq_len, threads=threads,
                     num_draft_tokens=given["num_draft_tokens"] or 5, tree=given["tree"], acceptance=acceptance,
                     adaptive=bool(given["adaptive"]), ngram_max=ngram_max, ngram_min=ngram_min,
                     tree_nodes=given["tree_nodes"], beam=given["beam"], slots=slots,
                     backend=backend, exec_mode=exec_mode, allow_inexact=allow_inexact, verify=verify,
                     kv_dtype=kv_dtype, auto_candidates=auto_candidates.split(",") if auto_candidates else None,
                     **{k: v for k, v in (("suffix_store", suffix_store), ("suffix_min_prob", suffix_min_prob),
                                          ("suffix_threshold", suffix_threshold), ("fan", given["fan"]))
                        if v is not None})


def check_fan(fan: int | None, drafters) -> None:
    """`--fan` is refused where none of the drafters that will run has a first step to widen."""
    from specrt.errors import SpecrtError

    if fan is not None and not set(drafters) & set(FANNED):
        raise SpecrtError(f"--fan widens the first step of {', '.join(FANNED)}; drafter {', '.join(drafters)} has no "
                          "such step: drop --fan or name one of them with --drafter")


def sampling_params(temperature, top_k, top_p, seed):
    from specrt.runtime.sampling import SamplingParams

    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def available_drafters(manifest) -> list[str]:
    """Every runtime drafter the bundle can run: plain, ngram, the draft model and learned drafters."""
    from specrt.kinds import kinds

    return [name for spec in kinds().values() if spec.available_in(manifest) for name in spec.runtime]


def echo_exactness(record: dict) -> None:
    """One line per measured machine: each mode's worst |Δlogits| and the mode auto runs."""
    from specrt.runtime.exactness import describe_measured
    from specrt.runtime.machine import Fingerprint

    where = Fingerprint.from_dict(record["fingerprint"]).describe()
    modes = describe_measured(record["measured"])
    verdict = f"mode {record['chosen']}: speculative output is exact" if record["chosen"] else \
        "NO mode is exact: speculation falls back to plain decoding unless --allow-inexact"
    click.echo(f"batch invariance on {where}: verify vs plain max |Δlogits| {modes} → {verdict}",
               err=record["chosen"] is None)



def _interrupt(signum, frame):
    raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """SIGTERM (a `kill`, a session's end) stops a long command as Ctrl-C does: it keeps what it finished."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
