"""The openvino peer family: OpenVINO GenAI's LLMPipeline on its own int4 conversion of the bundle's source.

openvino-genai, optimum-intel and nncf conflict with specrt's packages, so they live in a venv of their
own ($SPECRT_HOME/peers/venvs/openvino, `make setup-peers`); `openvino_python()` names its interpreter
and `make_peers` runs `openvino_peers` in a worker process of that interpreter. This module is imported
both there and in specrt's venv (by tools/peers.py), so at module level it imports only the standard
library, specrt.errors and specrt.tools.peer_types; openvino_genai and numpy are imported in the worker.

Three engines, each fed the prompt's token ids as specrt encoded them, greedy, stopped at the model's
EOS ids (the EOS token kept, as specrt keeps it):
    openvino-plain   plain greedy decoding (its own reference)
    openvino-lookup  prompt lookup decoding (`prompt_lookup=True`), held to openvino-plain
    openvino-draft   speculative decoding with the target's first N layers as the draft model
                     (N: the bundle's draft's layers, as `specrt export` makes it), held to openvino-plain
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.tools.peer_types import Peer

SETUP = "make setup-peers"  # builds the venv and the converted models (mk/openvino.mk)
# The same values as tools/peers.py's PROMPT_LOOKUP_TOKENS and ORTGENAI_NGRAM (a test holds them equal;
# that module cannot be imported here: it imports every family, ours included).
LOOKUP_TOKENS = 10  # draft tokens per step of prompt lookup, as every other lookup peer
LOOKUP_NGRAM = 3  # the longest prompt n-gram matched (onnxruntime-genai's ngram_size, specrt's --ngram-max)
DRAFT_TOKENS = 5  # draft tokens per step of the draft model: specrt's default chain (-k 5), OpenVINO's sample value


def openvino_venv() -> Path:
    """$SPECRT_HOME/peers/venvs/openvino (mk/openvino.mk's OPENVINO_VENV)."""
    from specrt.paths import home

    return home() / "peers" / "venvs" / "openvino"


def openvino_python() -> str:
    """The openvino venv's interpreter, for the family's worker process; refused when it is not built."""
    venv = openvino_venv()
    python = venv / "bin" / "python"
    if not (venv / ".installed").is_file() or not python.is_file():
        raise SpecrtError(f"the openvino peers run in their own venv {venv}, which is not built: run `{SETUP}` "
                          "(or `make setup-peer-openvino`), or leave openvino out of --peers")
    return str(python)


def draft_layers_of(manifest) -> int:
    """Layers of OpenVINO's draft model: those of the bundle's draft (a copy of the target's first N
    layers, maybe fine-tuned by `specrt train draft`: OpenVINO gets the plain copy), else export's default."""
    from specrt.tools.openvino_models import DRAFT_LAYERS

    draft = manifest.graphs.get("draft")
    return int(draft.config.num_layers) if draft is not None else DRAFT_LAYERS


def model_folders(manifest) -> tuple[Path, Path]:
    """The converted target and draft of the bundle's source; refused, naming the fix, when absent."""
    from specrt.tools.openvino_models import draft_dir, is_converted, target_dir
    from specrt.tools.peer_models import model_name

    model, layers = model_name(manifest.target.source), draft_layers_of(manifest)
    folders = (target_dir(model), draft_dir(model, layers))
    for folder in folders:
        if not is_converted(folder):
            raise SpecrtError(f"the openvino peers run OpenVINO's int4 conversion of {manifest.target.source}, but "
                              f"{folder} is not converted: run `{SETUP}` (the draft has {layers} layers: "
                              f"`make setup-peer-openvino OPENVINO_DRAFT_LAYERS={layers}`), or leave openvino out "
                              "of --peers")
    return folders


def generation_config(ov_genai, eos: list[int], max_new_tokens: int, **extra):
    """Greedy, `max_new_tokens`, stopped at any of `eos` (its token kept in the output); nothing from the
    model's generation_config.json (sampling, penalties) left to change the tokens."""
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = max_new_tokens
    cfg.do_sample = False
    cfg.num_beams = 1
    cfg.repetition_penalty = 1.0
    cfg.ignore_eos = False
    cfg.apply_chat_template = False  # the ids are specrt's, chat template applied or not as it chose
    if eos:
        cfg.eos_token_id = eos[0]
        cfg.stop_token_ids = set(eos)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def _runner(pipe, ov, ov_genai, np, eos: list[int], **extra) -> Callable:
    def run(ids: list[int], max_new_tokens: int):
        x = np.asarray([ids], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(x), ov.Tensor(np.ones_like(x)))  # ids in, ids out
        cfg = generation_config(ov_genai, eos, max_new_tokens, **extra)
        t0 = time.perf_counter()
        out = pipe.generate(inputs, cfg)
        seconds = time.perf_counter() - t0
        new = [int(t) for t in out.tokens[0]]
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        return new[:min(stop, max_new_tokens)], seconds

    return run


# CPU plugin properties the runs depend on: what the settings record (read back from the plugin when left
# at its default), and what `exact` sets. By default the plugin runs as users run it: on a CPU with bf16
# (AMX / AVX-512 BF16) its activations are bf16, its KV cache u8, and an int4 MatMul quantizes its
# activations to int8 in groups of 32. A verify pass over several rows (prompt lookup, the draft) then
# differs from one row's decode: other kernels, and the rows of the pass attend to each other's keys
# before they are quantized into the cache; a near-tie can flip and the speculative output drift from
# the plain one (the bench's identity column says so). `exact`: f32 activations, no dynamic quantization,
# an f32 KV cache: measured here, all three engines then give the same tokens (each property alone is
# not enough).
PRECISION_KEYS = ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "DYNAMIC_QUANTIZATION_GROUP_SIZE")
EXACT = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, "KV_CACHE_PRECISION": "f32"}


def device_properties(threads: int, exact: bool = False) -> dict:
    """The CPU properties of every pipeline: `threads` inference threads (specrt's thread count), paged
    attention (the backend OpenVINO's speculative decoding needs; the plain run's too, so all three
    share one), and EXACT's precision when `exact`."""
    return {"INFERENCE_NUM_THREADS": int(threads), "ATTENTION_BACKEND": "PA", **(EXACT if exact else {})}


def precision_settings(ov, props: dict) -> dict:
    """PRECISION_KEYS as the runs get them: set in `props`, else the CPU plugin's default here."""
    core = ov.Core()
    values = {k: props[k] if k in props else core.get_property("CPU", k) for k in PRECISION_KEYS}
    return {k.lower(): v.get_type_name() if hasattr(v, "get_type_name") else v for k, v in values.items()}


def openvino_peers(manifest, threads: int, max_seq_len: int | None = None, exact: bool = False) -> dict[str, Peer]:
    """OpenVINO GenAI's LLMPipeline (CPU, `threads` inference threads) on its int4 model of the bundle's
    source: plain greedy, prompt lookup, and speculative decoding with the truncated draft. `exact`: the
    EXACT precision instead of the plugin's defaults. (`max_seq_len`: paged attention sizes its own KV
    cache; not used.)"""
    target, draft = model_folders(manifest)
    try:
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai
    except ImportError:
        raise SpecrtError(f"the openvino peers need openvino-genai in {openvino_venv()}: run `{SETUP}`") from None
    from specrt.tools.openvino_models import RECORD

    device = device_properties(threads, exact)
    eos = [int(t) for t in manifest.target.config.eos_token_ids]
    record = json.loads((target / RECORD).read_text())
    draft_record = json.loads((draft / RECORD).read_text())
    settings = {"engine": f"openvino-genai {ov_genai.get_version()}", "versions": record.get("versions"),
                "threads": threads, "device": "CPU", "attention_backend": device["ATTENTION_BACKEND"],
                "exact": exact, **precision_settings(ov, device), "model": str(target),
                **{k: record["options"][k] for k in ("weight_format", "group_size", "ratio", "sym", "all_layers")}}
    lookup = {"num_assistant_tokens": LOOKUP_TOKENS, "max_ngram_size": LOOKUP_NGRAM}
    speculative = {"num_assistant_tokens": DRAFT_TOKENS}
    bundle_draft = manifest.graphs.get("draft")
    draft_settings = {"draft_model": str(draft), "draft_layers": draft_record["draft"]["layers"],
                      "draft_of_layers": draft_record["draft"]["of"],
                      "bundle_draft": bundle_draft.source if bundle_draft is not None else None}
    draft_device = {k: v for k, v in device.items() if k != "ATTENTION_BACKEND"}  # the main pipeline's choice

    plain = ov_genai.LLMPipeline(str(target), "CPU", **device)
    lookup_pipe = ov_genai.LLMPipeline(str(target), "CPU", prompt_lookup=True, **device)
    draft_pipe = ov_genai.LLMPipeline(str(target), "CPU", draft_model=ov_genai.draft_model(str(draft), "CPU",
                                                                                            **draft_device), **device)
    return {
        "openvino-plain": Peer(_runner(plain, ov, ov_genai, np, eos), reference=None, settings=settings),
        "openvino-lookup": Peer(_runner(lookup_pipe, ov, ov_genai, np, eos, **lookup), reference="openvino-plain",
                                settings={**settings, **lookup}),
        "openvino-draft": Peer(_runner(draft_pipe, ov, ov_genai, np, eos, **speculative), reference="openvino-plain",
                               settings={**settings, **speculative, **draft_settings}),
    }
