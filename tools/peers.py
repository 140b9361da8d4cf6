"""Other engines measured beside specrt in `specrt bench --peers` (optional: `pip install 'specrt[peers]'`).

A peer family ("transformers", "llamacpp", "ortgenai") is a factory: (manifest, threads, max_seq_len) ->
{engine name: Peer}; max_seq_len is the context to size for (specrt's KV capacity; None: specrt's
default). Every engine gets the prompt's token ids as specrt encoded them, decodes greedily, stops at
the model's EOS ids (the EOS token is kept in the output, as specrt keeps it) and returns (new ids,
seconds). A speculative peer names its own engine's plain greedy run as its `reference`: `run_bench`
checks that its output is identical to that one; a plain peer is a reference itself.

`make_peers` runs each family in its own worker process (tools/peer_worker.py), as users run these
engines, so none shares specrt's process, allocator or thread pools; `in_process=True` calls the
factories here. `peer_worker.close_peers` ends the workers (they are also ended at exit).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.tools.peer_models import BUILD_COMMAND, ORTGENAI_OPTIONS, is_built, ortgenai_dir
from specrt.tools.peer_types import Peer
from specrt.tools.peer_worker import in_workers
from specrt.tools.peers_openvino import openvino_peers, openvino_python
from specrt.tools.peers_vllm import vllm_peers, vllm_python

EXTRA = "pip install 'specrt[peers]'"
# Draft tokens per step for the prompt-lookup peers: transformers' documented example value and
# llama-cpp-python's LlamaPromptLookupDecoding default (onnxruntime-genai's max_draft_tokens, the same).
PROMPT_LOOKUP_TOKENS = 10
ORTGENAI_NGRAM = 3  # onnxruntime-genai's n-gram lookup: the suffix length it matches (specrt's --ngram-max)
TRUNCATED = re.compile(r" \(first (\d+) of (\d+) layers\)$")  # how export_bundle names a truncated draft


# ---- Hugging Face transformers ----------------------------------------------------------------------

def _import_torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise SpecrtError(f"the transformers peers need torch and transformers: {EXTRA}") from None
    return torch


def _load_hf(source: str):
    """The transformers model of a bundle source (HF folder or GGUF, dequantized to fp32)."""
    from specrt.export.loading import load_model

    if source.lower().endswith(".gguf"):
        try:
            import gguf  # noqa: F401
        except ImportError:
            raise SpecrtError(f"the transformers peers read {source} with the gguf package: "
                              f"{EXTRA}") from None
    return load_model(source).hf_model.eval()


def _draft_overlay(folder: Path) -> dict | None:
    """Weights of a fine-tuned specrt draft checkpoint (`specrt train draft`), by transformers name."""
    cfg = folder / "config.json"
    try:
        kind = json.loads(cfg.read_text()).get("kind") if cfg.is_file() else None
    except (OSError, json.JSONDecodeError):
        kind = None
    from specrt.kinds import kinds

    if kind not in kinds() or kinds()[kind].bundle_role != "draft":  # a checkpoint of the bundle's draft model
        return None
    from safetensors.torch import load_file

    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise SpecrtError(f"{weights} is missing: the bundle's draft checkpoint {folder} is incomplete")
    # TruncatedDraft keeps the decoder under `lm.`; its names are the transformers ones (module_from_hf).
    return {k.removeprefix("lm."): v for k, v in load_file(weights).items()}


def assistant_model(manifest, hf):
    """The bundle's draft model as a transformers model of the target's class, for `assistant_model`.

    specrt's default draft is the target's first N layers plus final norm and head (N: the "draft"
    graph's num_layers), optionally fine-tuned (`specrt train draft`); an independent draft model
    (`--draft-model`) is loaded from its own source.
    """
    torch = _import_torch()
    draft = manifest.graphs.get("draft")
    if draft is None:
        raise SpecrtError("transformers-assisted runs the bundle's draft model, but this bundle has none: "
                          "export it with `specrt export --draft-layers N`, or leave transformers out of "
                          "--peers")
    n, source = draft.config.num_layers, draft.source
    overlay = None if TRUNCATED.search(source) else _draft_overlay(Path(source))
    if not TRUNCATED.search(source) and overlay is None:
        path = Path(source)
        if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
            return _load_hf(source)  # an independent draft model sharing the tokenizer
        why = "it is neither a model folder nor a .gguf file" if path.exists() else "it does not exist"
        raise SpecrtError(f"transformers-assisted runs the bundle's draft model, but its source {source!r} "
                          f"cannot be loaded ({why}): put it back or export the bundle again")
    cfg = copy.deepcopy(hf.config)
    if draft.config.hidden_size != cfg.hidden_size:
        raise SpecrtError(f"the bundle's draft ({source}) has hidden size {draft.config.hidden_size}, "
                          f"not the target's {cfg.hidden_size}: cannot rebuild it from the target")
    cfg.num_hidden_layers = n
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:n]
    assistant = type(hf)(cfg).to(torch.float32).eval()
    own = assistant.state_dict()
    state = {k: v for k, v in hf.state_dict().items() if k in own}
    if overlay:
        unknown = sorted(set(overlay) - set(own))
        if unknown:
            raise SpecrtError(f"draft checkpoint {source} does not fit {type(hf).__name__} with {n} layers: "
                              f"unexpected {unknown[:4]}")
        state.update(overlay)
    missing = sorted(set(own) - set(state))
    if missing:
        raise SpecrtError(f"cannot build the {n}-layer assistant from {manifest.target.source}: "
                          f"missing {missing[:4]}")
    assistant.load_state_dict(state, strict=True)
    return assistant


def _hf_runner(hf, eos: list[int], **extra) -> Callable:
    import torch

    def run(ids: list[int], max_new_tokens: int):
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                            do_sample=False, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                            **extra)
        return y[0, len(ids):].tolist(), time.perf_counter() - t0

    return run


def transformers_peers(manifest, threads: int, max_seq_len: int | None = None) -> dict[str, Peer]:
    """transformers `generate` on the bundle's source model: plain greedy, prompt lookup, and assisted
    generation with the bundle's draft model as the assistant."""
    torch = _import_torch()
    import transformers

    torch.set_num_threads(threads)
    hf = _load_hf(manifest.target.source)
    assistant = assistant_model(manifest, hf)
    eos = list(manifest.target.config.eos_token_ids)
    version = {"engine": f"transformers {transformers.__version__}", "threads": threads}
    return {
        "transformers-plain": Peer(_hf_runner(hf, eos), reference=None, settings=version),
        "transformers-prompt-lookup": Peer(
            _hf_runner(hf, eos, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS),
            reference="transformers-plain",
            settings={**version, "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        "transformers-assisted": Peer(
            _hf_runner(hf, eos, assistant_model=assistant), reference="transformers-plain",
            settings={**version, "assistant_layers": assistant.config.num_hidden_layers,
                      "assistant_source": manifest.graphs["draft"].source}),
    }


# ---- llama.cpp (llama-cpp-python) --------------------------------------------------------------------

def _gguf_source(manifest) -> Path:
    source = Path(manifest.target.source)
    if source.suffix.lower() != ".gguf":
        raise SpecrtError(f"the llamacpp peers run the GGUF the bundle was exported from, but this bundle's "
                          f"source is {source} (not a .gguf file): export the bundle from a GGUF "
                          "(`specrt export MODEL.gguf`), or leave llamacpp out of --peers")
    if not source.is_file():
        raise SpecrtError(f"the llamacpp peers run the bundle's source GGUF {source}, which does not exist: "
                          "put it back there or export the bundle again")
    return source


def _llama_runner(llm, eos: set[int], n_ctx: int) -> Callable:
    def run(ids: list[int], max_new_tokens: int):
        if len(ids) + max_new_tokens > n_ctx:
            raise SpecrtError(f"llama.cpp context {n_ctx} < prompt {len(ids)} + {max_new_tokens} new tokens: "
                              "raise --max-seq-len or lower --max-new-tokens")
        out: list[int] = []
        llm.reset()  # no prefix reuse from the previous run: every run prefills its whole prompt
        t0 = time.perf_counter()
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if out[-1] in eos or len(out) >= max_new_tokens:
                break
        return out, time.perf_counter() - t0

    return run


def llamacpp_peers(manifest, threads: int, max_seq_len: int | None = None) -> dict[str, Peer]:
    """llama.cpp (through llama-cpp-python) on the bundle's source GGUF: plain greedy and prompt lookup."""
    source = _gguf_source(manifest)
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise SpecrtError(f"the llamacpp peers need llama-cpp-python: {EXTRA}") from None
    cfg = manifest.target.config
    # specrt's KV capacity (Generator's default when None); the prompt-lookup context keeps logits for
    # every row (n_ctx x vocab floats), so it is not sized to the model's whole trained context.
    n_ctx = int(max_seq_len or min(2048, cfg.max_position_embeddings))
    eos = set(cfg.eos_token_ids)

    def load(draft=None):
        return llama_cpp.Llama(model_path=str(source), n_ctx=n_ctx, n_threads=threads,
                               n_threads_batch=threads, draft_model=draft, seed=0, verbose=False)

    version = {"engine": f"llama-cpp-python {llama_cpp.__version__}", "threads": threads, "n_ctx": n_ctx}
    return {
        "llamacpp-plain": Peer(_llama_runner(load(), eos, n_ctx), reference=None, settings=version),
        "llamacpp-prompt-lookup": Peer(
            _llama_runner(load(LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)), eos, n_ctx),
            reference="llamacpp-plain", settings={**version, "num_pred_tokens": PROMPT_LOOKUP_TOKENS}),
    }


# ---- onnxruntime-genai ---------------------------------------------------------------------------------

def _ortgenai_runner(og, model, eos: set[int], context: int, speculative: dict | None = None) -> Callable:
    def run(ids: list[int], max_new_tokens: int):
        if len(ids) + max_new_tokens > context:
            raise SpecrtError(f"the onnxruntime-genai model's context {context} < prompt {len(ids)} + "
                              f"{max_new_tokens} new tokens: lower --max-new-tokens")
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        if speculative:
            params.set_speculative_options(**speculative)
        gen = og.Generator(model, params)  # its KV buffers, sized to max_length: set up before the clock
        out: list[int] = []
        t0 = time.perf_counter()
        gen.append_tokens(ids)  # the prefill
        while len(out) < max_new_tokens and not gen.is_done():
            gen.generate_next_token()
            new = [int(t) for t in gen.get_next_tokens()]
            out.extend(new)
            if eos.intersection(new):
                break
        seconds = time.perf_counter() - t0
        stop = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
        return out[:min(stop, max_new_tokens)], seconds

    return run


def ortgenai_peers(manifest, threads: int, max_seq_len: int | None = None) -> dict[str, Peer]:
    """onnxruntime-genai's Generator on its own int4 CPU build of the bundle's source (`make peer-models`):
    plain greedy decoding, and its n-gram speculative decoding (prompt lookup, verified greedily)."""
    folder = ortgenai_dir(manifest.target.source)
    if not is_built(folder):
        raise SpecrtError(f"the ortgenai peer runs onnxruntime-genai's int4 model of {manifest.target.source}, "
                          f"but {folder} is not built: run `{BUILD_COMMAND}` (or `python -m "
                          "specrt.tools.peer_models BUNDLE`), or leave ortgenai out of --peers")
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise SpecrtError(f"the ortgenai peer needs onnxruntime-genai: {EXTRA}") from None
    config = og.Config(str(folder))
    # its ONNX Runtime session gets the same thread count as specrt's
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    context = int(genai.get("context_length") or manifest.target.config.max_position_embeddings)
    eos = set(manifest.target.config.eos_token_ids)
    settings = {"engine": f"onnxruntime-genai {og.__version__}", "threads": threads, "model": str(folder),
                **{k: v for k, v in ORTGENAI_OPTIONS.items() if k != "execution_provider"}}
    lookup = {"ngram_size": ORTGENAI_NGRAM, "max_draft_tokens": PROMPT_LOOKUP_TOKENS}
    return {"ortgenai-plain": Peer(_ortgenai_runner(og, model, eos, context), reference=None, settings=settings),
            "ortgenai-prompt-lookup": Peer(_ortgenai_runner(og, model, eos, context, lookup),
                                           reference="ortgenai-plain", settings={**settings, **lookup})}


# ---- registry ----------------------------------------------------------------------------------------

PEERS: dict[str, Callable[..., dict[str, Peer]]] = {"transformers": transformers_peers,
                                                    "llamacpp": llamacpp_peers,
                                                    "ortgenai": ortgenai_peers,
                                                    "vllm": vllm_peers,
                                                    "openvino": openvino_peers}
# families whose packages conflict with ours: their worker runs the interpreter of a venv of their own
# (`make setup-peers` builds it; the function raises a SpecrtError naming that command when it is absent)
PEER_PYTHON: dict[str, Callable[[], str]] = {"vllm": vllm_python, "openvino": openvino_python}
SPECRT_BUNDLE = "specrt-bundle"  # the worker family of another specrt bundle (baseline_peer, exec_mode_peers)


def parse_peers(spec: str | None) -> list[str]:
    """Peer families from `--peers`: a comma list of PEERS names, or `all`; checked before any loading."""
    names: list[str] = []
    for n in (p.strip() for p in (spec or "").split(",")):
        if not n:
            continue
        if n == "all":
            names.extend(PEERS)
        elif n in PEERS:
            names.append(n)
        else:
            raise SpecrtError(f"unknown peer {n!r}: choose from {', '.join(PEERS)}, or all")
    return list(dict.fromkeys(names))


def make_peers(names: list[str] | str, manifest, threads: int, max_seq_len: int | None = None,
               in_process: bool = False) -> dict[str, Peer]:
    """{engine name: Peer} for the requested families (a list, or the `--peers` string), each family
    loaded in its own worker process (in this one with `in_process`)."""
    names = parse_peers(names if isinstance(names, str) else ",".join(names))
    if not in_process:
        return in_workers({n: (PEERS[n], (manifest, threads, max_seq_len), {},
                               *([PEER_PYTHON[n]()] if n in PEER_PYTHON else [])) for n in names})
    out: dict[str, Peer] = {}
    for n in names:
        out.update(PEERS[n](manifest, threads, max_seq_len))
    return out


# ---- another specrt bundle (the fp32 twin of a quantized bundle) -----------------------------------

def baseline_peer(bundle: Path, threads: int, max_seq_len: int | None = None,
                  in_process: bool = False) -> dict[str, Peer]:
    """Plain decoding on another bundle, e.g. the fp32 export beside an int4 one: `specrt-fp32-plain`
    (named after the bundle's quantization). Its own reference; `same_as_specrt_plain` then says
    whether quantization changed the greedy output. Runs in its own worker unless `in_process`."""
    if not in_process:
        return in_workers({SPECRT_BUNDLE: (baseline_peer, (Path(bundle), threads, max_seq_len),
                                           {"in_process": True})})
    from specrt.runtime.generate import Generator

    gen = Generator(bundle, "plain", max_seq_len=max_seq_len, threads=threads)
    scheme = gen.manifest.artifacts.get("quantization", {}).get("scheme", "fp32")

    def run(ids: list[int], max_new_tokens: int):
        res = gen.generate_ids(ids, max_new_tokens)
        return res.token_ids, res.stats.seconds

    settings = {"bundle": str(bundle), "exact_to": gen.reference.to_dict()}  # the reference it is (bench)
    return {f"specrt-{scheme}-plain": Peer(run, reference=None, settings=settings)}


def variant_peers(bundle: Path, tag: str, drafters: list[str], threads: int, max_seq_len: int | None = None,
                  in_process: bool = False, **options) -> dict[str, Peer]:
    """The same bundle under other Generator `options` (an execution mode, a backend), plain and with each
    drafter, in its own worker unless `in_process`: `specrt-TAG-plain` is its own reference (an engine
    of its own), each drafter is checked against it, and `same_as_specrt_plain` says whether its plain
    output equals the main run's."""
    if not in_process:
        return in_workers({SPECRT_BUNDLE: (variant_peers, (Path(bundle), tag, list(drafters), threads, max_seq_len),
                                           {"in_process": True, **options})})
    from specrt.runtime.generate import Generator

    gen = Generator(bundle, "plain", max_seq_len=max_seq_len, threads=threads, **options)

    def runner(drafter: str):
        def run(ids: list[int], max_new_tokens: int):
            res = gen.use(drafter).generate_ids(ids, max_new_tokens)
            return res.token_ids, res.stats.seconds

        return run

    plain = f"specrt-{tag}-plain"
    settings = {"bundle": str(bundle), **options, "batch_invariant": gen.exactness.lossless,
                "exact_to": gen.reference.to_dict()}  # the reference its plain run is (bench)
    peers = {plain: Peer(runner("plain"), reference=None, settings=settings)}
    for d in drafters:
        if d != "plain":
            peers[f"specrt-{tag}-{d}"] = Peer(runner(d), reference=plain, settings=settings)
    return peers


def backend_peers(bundle: Path, backend: str, drafters: list[str], threads: int,
                  max_seq_len: int | None = None) -> dict[str, Peer]:
    """The same bundle on another backend (e.g. `ort-fused`): what it saves, measured in the same run."""
    return variant_peers(bundle, backend, drafters, threads, max_seq_len, backend=backend)


def exec_mode_peers(bundle: Path, mode: str, drafters: list[str], threads: int,
                    max_seq_len: int | None = None) -> dict[str, Peer]:
    """The same bundle run in execution mode `mode` (e.g. `direct`, unpadded), plain and with each
    drafter: what the mode the runtime chose costs or saves, measured in the same run. Speculation runs
    even where `mode` is not exact here (allow_inexact); `identical_to_plain` then shows what that costs."""
    return variant_peers(bundle, mode, drafters, threads, max_seq_len, exec_mode=mode, allow_inexact=True)
