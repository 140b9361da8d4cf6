# OpenVINO GenAI peer (`specrt bench --peers openvino`): its own venv, since openvino-genai, optimum-intel
# and nncf pin packages that conflict with ours; its worker process runs this venv's interpreter.
# Then its int4 conversions of the default model (target + truncated draft) by tools/openvino_models.py.
OPENVINO_VENV ?= $(SPECRT_HOME)/peers/venvs/openvino
OPENVINO_PY := $(OPENVINO_VENV)/bin/python
OPENVINO_GENAI_SPEC ?= openvino-genai==2026.4.1.0
OPTIMUM_INTEL_SPEC ?= optimum-intel==2.2.0
NNCF_SPEC ?= nncf==3.4.0
OPENVINO_PEER_SOURCE ?= $(SPECRT_HOME)/models/SmolLM2-135M-Instruct.Q4_1.gguf
# the draft: the target's first N layers, as `specrt export --draft-layers N` (default 4)
OPENVINO_DRAFT_LAYERS ?= 4

# torch first and pinned in every later install, so pip never swaps it for another build. optimum-intel
# pulls PyPI's torchvision, whose kernels do not load with that CPU torch ("operator torchvision::nms does
# not exist", breaking every transformers import): it is removed, nothing a text model's export runs needs it.
$(OPENVINO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_PY) -m pip install --quiet --upgrade pip
	$(OPENVINO_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(OPENVINO_PY) -m pip install --quiet "$(TORCH_SPEC)" "$(OPENVINO_GENAI_SPEC)" "$(OPTIMUM_INTEL_SPEC)" \
		"$(NNCF_SPEC)"
	$(OPENVINO_PY) -m pip uninstall --quiet --yes torchvision
	$(OPENVINO_PY) -m pip install --quiet --no-deps -e .
	touch $@

# The converted int4 models, stamped per draft size (idempotent besides: tools/openvino_models.py skips
# a model whose record is there).
# The fp32 HF folder they are made from comes from our venv (shared with the other peers' conversions).
$(OPENVINO_VENV)/.models-first$(OPENVINO_DRAFT_LAYERS): $(OPENVINO_VENV)/.installed tools/openvino_models.py | setup
	HF=$$($(PY) -c 'import sys; from specrt.tools.peer_models import ensure_hf_folder; \
		print(ensure_hf_folder(sys.argv[1], log=lambda m: print(m, file=sys.stderr)))' \
		"$(OPENVINO_PEER_SOURCE)") && \
	$(OPENVINO_PY) -m specrt.tools.openvino_models --hf "$$HF" --draft-layers $(OPENVINO_DRAFT_LAYERS)
	touch $@

.PHONY: setup-peer-openvino
setup-peer-openvino: $(OPENVINO_VENV)/.models-first$(OPENVINO_DRAFT_LAYERS)
