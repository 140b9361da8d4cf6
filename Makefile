# specrt — two commands on a fresh machine:
#   make run    set up, export + build the default model's bundle, generate with speculative decoding
#   make test   set up and run the test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SPECRT := $(VENV)/bin/specrt
# This workplace ships a CPU build of torch 2.13.0 on local disk; elsewhere set TORCH_SPEC=torch.
TORCH_SPEC ?= torch==2.13.0
export SPECRT_HOME ?= $(CURDIR)/artifacts
BUNDLE ?= $(SPECRT_HOME)/bundles/smollm2-135m-instruct
# Weight-only quantization of the default bundle (int4, int8, or empty for fp32). The fp32 twin is the
# baseline `make bench` measures against in the same run.
QUANTIZE ?= int4
FP32_BUNDLE ?= $(SPECRT_HOME)/bundles/smollm2-135m-instruct-fp32
PROMPT ?= Rewrite this sentence in the passive voice: The committee approved the new budget after a long debate on Tuesday.
DRAFTER ?= eagle3-suffix
THREADS ?= 2
SOURCES := $(shell find specrt export runtime plugins engines -name '*.py' -o -name '*.jsonl' 2>/dev/null)
# Learned drafters: `make train` writes $(SPECRT_HOME)/drafters/KIND; `make export` adds every one found.
# every learned kind in the registry (specrt/kinds/), in listing order
KINDS ?= $(shell $(PY) -c 'from specrt.kinds import learned_kinds; print(*learned_kinds())')
TRAIN_MINUTES ?= 20
# Distillation data at scale: `make distill` fills (or resumes) this store; `make train` trains on it. 3.6 M
# answer tokens: one greedy answer to every prompt it is given (~23,000: ~2 hours at ~500 tokens/s on 2 cores).
STORE ?= $(SPECRT_HOME)/train/store
DISTILL_TOKENS ?= 3600000
# The drafter shipped for the default model (weights in git; `make train-shipped` trains it on, warm). One
# trained under $(SPECRT_HOME)/drafters of the same kind takes its place.
SHIPPED_DRAFTERS ?= drafters/smollm2-135m-instruct
TRAINED := $(wildcard $(SPECRT_HOME)/drafters/*/model.safetensors $(SHIPPED_DRAFTERS)/*/model.safetensors)
# evaluated when the recipe runs, so drafters trained earlier in the same `make` are included
DRAFTER_FLAGS = $$(for f in $(SPECRT_HOME)/drafters/*/model.safetensors; do [ -f "$$f" ] && \
	echo --drafter $$(basename $$(dirname "$$f")); done; for d in $(SHIPPED_DRAFTERS)/*; do k=$$(basename "$$d"); \
	[ -f "$$d/model.safetensors" ] && [ ! -f "$(SPECRT_HOME)/drafters/$$k/model.safetensors" ] && echo --drafter "$$k=$$d"; done)

.PHONY: train-shipped train-round distill serve serve-triton bench-serve load-serve setup setup-peers peer-models export build run test bench bench-drafters tune train validate lint doctor clean distclean help gpu-check

help:
	@echo "make run | setup | setup-peers | peer-models | export | build | test | bench | serve | serve-triton | bench-serve | load-serve | tune | distill | train | train-shipped | train-round | bench-drafters | validate | gpu-check | lint | doctor | clean"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[export,serve,dev]"
	touch $@

$(SPECRT_HOME)/models/SmolLM2-135M-Instruct.Q4_1.gguf: $(VENV)/.installed
	$(PY) -c "from specrt.export.default_model import default_model_path; print(default_model_path())"

# The native backend's kernels, compiled with the machine's g++ (seconds, once per source digest); without a
# compiler the runtime's default backend is ONNX Runtime, and this says so in one line.
setup: $(VENV)/.installed $(SPECRT_HOME)/models/SmolLM2-135M-Instruct.Q4_1.gguf
	@$(PY) -m specrt.engines.native.library || echo "note: the native kernels did not build here (above): --backend auto runs ort"

$(BUNDLE)/manifest.json: $(SOURCES) $(TRAINED) | setup
	$(SPECRT) export -o $(BUNDLE) $(if $(QUANTIZE),--quantize $(QUANTIZE)) $(DRAFTER_FLAGS)

$(FP32_BUNDLE)/manifest.json: $(SOURCES) | setup
	$(SPECRT) export -o $(FP32_BUNDLE) && $(SPECRT) build $(FP32_BUNDLE)

# The peers' packages (llama-cpp-python builds llama.cpp from source: ~8 minutes, once; onnxruntime-genai
# is a wheel; not part of `make test`).
# Built for the CPU it runs on: scripts/llama_cmake_args.py pins the x86 features /proc/cpuinfo reports
# (AVX2-only and AVX-512 machines alike) and keeps AMX off, which faults on VMs that advertise it.
LLAMA_CMAKE_ARGS ?= $(shell $(PYTHON) scripts/llama_cmake_args.py)
$(VENV)/.peers: $(VENV)/.installed
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PY) -m pip install --quiet -e ".[peers]"
	touch $@

# vLLM's CPU engine and OpenVINO GenAI conflict with our packages: each gets a venv of its own
# (mk/vllm.mk, mk/openvino.mk), and its worker process runs that venv's interpreter.
include mk/vllm.mk mk/openvino.mk
setup-peers: $(VENV)/.peers setup-peer-vllm setup-peer-openvino

# onnxruntime-genai's own int4 CPU build of the default model's source, for the ortgenai peer (about a
# minute, once): $(SPECRT_HOME)/peers/ortgenai/<model>-int4, its build record written last.
PEER_SOURCE ?= $(SPECRT_HOME)/models/SmolLM2-135M-Instruct.Q4_1.gguf
ORTGENAI_MODEL := $(SPECRT_HOME)/peers/ortgenai/$(basename $(notdir $(PEER_SOURCE)))-int4
$(ORTGENAI_MODEL)/specrt_peer_model.json: $(PEER_SOURCE) | setup-peers
	$(PY) -m specrt.tools.peer_models --source $(PEER_SOURCE) --force

peer-models: $(ORTGENAI_MODEL)/specrt_peer_model.json

export: $(BUNDLE)/manifest.json

build: export
	$(SPECRT) build $(BUNDLE)

run: build
	$(SPECRT) generate $(BUNDLE) --drafter $(DRAFTER) --threads $(THREADS) --prompt "$(PROMPT)"

# The suite includes a real tritonserver (nvidia-pytriton's binary, installed without its dependencies).
test: setup $(VENV)/.triton-server
	$(PY) -m pytest -q --durations=25 tests

# Every drafter of the bundle, the peers (transformers, llama.cpp, onnxruntime-genai: each in its own
# process) and plain fp32 specrt, side by side in one run.
bench: build $(FP32_BUNDLE)/manifest.json setup-peers peer-models
	$(SPECRT) bench $(BUNDLE) --threads $(THREADS) --max-new-tokens 128 --repeats 2 --peers all \
		--baseline $(FP32_BUNDLE) --json $(SPECRT_HOME)/bench/latest.json --report $(SPECRT_HOME)/bench/report

# Measure drafter / tree / depth choices on the bench prompts; the fastest becomes the bundle's default.
tune: build
	$(SPECRT) tune $(BUNDLE) --threads $(THREADS)

# The deployed target's own answers at scale, with its own states as the features (resumable: run it again
# to go on after a stop), to every prompt file shipped beside the head (the target's own Magpie prompts of each
# kind, and requests about CPython 3.11's standard library: drafters/<model>/prompts/*.jsonl).
SHIPPED_PROMPTS = $(sort $(wildcard $(SHIPPED_DRAFTERS)/prompts/*.jsonl))
distill: build
	$(SPECRT) distill --backend native --target $(BUNDLE) --prompts specrt/data/train_prompts.jsonl \
		$(foreach f,$(SHIPPED_PROMPTS),--prompts $(f)) --tokens $(DISTILL_TOKENS) --slots 32 --store $(STORE)

# One resumable round of the shipped head's recipe from the answers kept in git (scripts/train_round.sh):
# replay them into $(STORE), train warm from the shipped head for at most TRAIN_MINUTES (REPLAY_MINUTES caps
# the replay), then export and score the head beside the shipped one. Run it in the background (nohup).
ANSWERS ?= $(wildcard $(SHIPPED_DRAFTERS)/answers/*.npz)
ROUND ?= $(SPECRT_HOME)/train/eagle3-round
train-round: build
	ANSWERS="$(ANSWERS)" OUT=$(ROUND) STORE=$(STORE) BUNDLE=$(BUNDLE) SHIPPED=$(SHIPPED_DRAFTERS)/$(SHIPPED_KIND) \
		TRAIN_MINUTES=$(TRAIN_MINUTES) THREADS=$(THREADS) SPECRT=$(SPECRT) PY=$(PY) bash scripts/train_round.sh

# Self-distil every drafter kind for the default model on the graph-featured store (≤ TRAIN_MINUTES each).
train: distill
	for k in $(KINDS); do $(SPECRT) train $$k --store $(STORE) --max-minutes $(TRAIN_MINUTES) || exit 1; done
	$(SPECRT) export -o $(BUNDLE) $(if $(QUANTIZE),--quantize $(QUANTIZE)) $(DRAFTER_FLAGS)

# The shipped drafter, trained again with the command its metrics.json records (SHIPPED_TRAIN_FLAGS).
SHIPPED_KIND ?= eagle3
SHIPPED_TRAIN_FLAGS ?= --init $(SHIPPED_DRAFTERS)/$(SHIPPED_KIND) --epochs 1.5 --max-minutes 120 --batch 8 --lr 3e-4 --steps 1 \
	--draft-vocab 4096 --save-dtype fp16
train-shipped: distill
	$(SPECRT) train $(SHIPPED_KIND) --store $(STORE) $(SHIPPED_TRAIN_FLAGS) -o $(SPECRT_HOME)/drafters/$(SHIPPED_KIND)

# Learned drafters on the held-out prompts (2 per category), side by side with plain and ngram.
bench-drafters: build
	$(SPECRT) bench $(BUNDLE) --prompts heldout --per-category 2 --threads $(THREADS) --max-new-tokens 128 \
		--json $(SPECRT_HOME)/bench/drafters.json

validate: build
	$(SPECRT) validate $(BUNDLE) --lossless --polygraphy --samples 1000

lint: setup
	$(VENV)/bin/ruff check .

doctor: setup
	$(SPECRT) doctor

clean:
	rm -rf $(SPECRT_HOME)/bundles $(SPECRT_HOME)/bench .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) $(SPECRT_HOME)

# Triton kernels on a CUDA GPU vs the NumPy references, kernel timing and a CUDA-graph replay
# (exit 2 without a CUDA GPU with torch+triton). Report: $(SPECRT_HOME)/gpu_check/report.md + .json
gpu-check: setup
	$(PY) scripts/gpu_check.py --out $(SPECRT_HOME)/gpu_check

# The OpenAI-compatible server over the default bundle (Ctrl-C to stop); PORT, SLOTS, SERVE_DRAFTER (many users
# share each pass there: the serving tables measured ngram, not the batch-1 default above).
PORT ?= 8000
SLOTS ?= 16
SERVE_DRAFTER ?= ngram
# The fastest exact serving here: auto, the native backend for the int4 bundle (docs/performance.md)
SERVE_BACKEND ?= auto
serve: build
	$(SPECRT) serve $(BUNDLE) --port $(PORT) --slots $(SLOTS) --drafter $(SERVE_DRAFTER) --threads $(THREADS) \
		--backend $(SERVE_BACKEND)

# A real Triton Inference Server (nvidia-pytriton's tritonserver, CPU) over the default bundle (Ctrl-C to stop):
# HTTP on PORT, gRPC on PORT+1, metrics on PORT+2; INSTANCES, SERVE_DRAFTER. nvidia-pytriton goes in without its
# dependencies: specrt runs only its binary, and its numpy<2 pin would replace this venv's numpy.
INSTANCES ?= 1
$(VENV)/.triton-server: $(VENV)/.installed
	$(PY) -m pip install --quiet --no-deps "nvidia-pytriton>=0.7"
	touch $@

serve-triton: $(BUNDLE)/manifest.json $(VENV)/.triton-server
	$(SPECRT) serve-triton $(BUNDLE) --http-port $(PORT) --grpc-port $$(($(PORT) + 1)) \
		--metrics-port $$(($(PORT) + 2)) --instances $(INSTANCES) --drafter $(SERVE_DRAFTER) --threads $(THREADS)

# 200 mixed requests at concurrency 16 (chat/completions, streamed or not, greedy and sampled) with each of
# LOAD_DRAFTERS: every greedy response held to single-request plain decoding; p50/p95 latency, RSS.
LOAD_DRAFTERS ?= ngram eagle3
load-serve: build
	for d in $(LOAD_DRAFTERS); do $(SPECRT) bench-serve $(BUNDLE) --mixed 200 --concurrency 16 --slots 8 \
		--max-tokens 64 --drafter $$d --threads $(THREADS) --json $(SPECRT_HOME)/bench/load-$$d.json || exit 1; done

# vLLM's CPU server and `specrt serve` under the same load, one after the other (make setup-peers first):
# 48 distinct held-out prompts at concurrency 1/4/16/32, streamed and not; tok/s, p50/p95 latency, TTFT and
# inter-token latency, texts equal to single-request.
bench-serve: build setup-peers
	$(SPECRT) bench-serve $(BUNDLE) --peer vllm --backend $(SERVE_BACKEND) --drafter plain --threads $(THREADS) \
		--concurrency 1,4,16,32 --prompts heldout --requests 48 --max-tokens 128 \
		--json $(SPECRT_HOME)/bench/serve-vllm.json
