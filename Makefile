# specserve: every target sets up its own venv from nothing (python3 -m venv + pip install -e .[test]).
# The test venv also holds vLLM's `speculators` library (no deps): the suite runs beside it, as users do.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
SPECULATORS_PIN := speculators==0.9.0
# Triton for the CUDA kernel's tests on CPU (interpreter mode, tests/test_triton_attention.py); kept out of the
# venv's own packages, where the CPU torch build has none
TRITON_PIN := triton==3.6.0

.PHONY: venv system-deps serve test test-structured-soak test-fast bench-decode bench-spec bench-baselines bench-paired bench-server-ab bench-vllm bench-report bench-coupled bench-structured bench-auto bench-tp bench-metrics bench-tree gpu-check gpu-check-run lint clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(SPECULATORS_PIN)
	touch $(STAMP)

venv: $(STAMP)

# the tests' own triton (interpreter mode on CPU), beside the venv's packages: only the test targets need it
TRITON_DIR := $(VENV)/triton-interp
$(TRITON_DIR)/.installed: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(TRITON_DIR) $(TRITON_PIN)
	touch $@

serve: venv
	$(BIN)/specserve serve --host $(HOST) --port $(PORT) $(ARGS)

# System tools the tests run for real: Debian's prometheus (prometheus + promtool) for the dashboard's PromQL
# and the compose config. Installed with apt-get when missing (as root, else sudo); says the command if it cannot.
system-deps:
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
	  SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
	  echo "installing Debian's prometheus (needed by tests/test_prometheus_dashboard.py)"; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null \
	  || { $$SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
	       $$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; } \
	  || { echo "could not install prometheus; run as root: apt-get update && apt-get install -y --no-install-recommends prometheus"; exit 1; }; \
	fi

test: venv system-deps $(TRITON_DIR)/.installed
	$(BIN)/python -m pytest -q -ra

# The structured-output randomized run at 10x make test's size (2000 requests: methods, k, T, schemas).
test-structured-soak: venv
	STRUCTURED_FUZZ_REQUESTS=2000 $(BIN)/python -m pytest -q tests/test_structured_fuzz.py

bench-decode: venv
	$(BIN)/python -m loadtest.bench_decode $(ARGS)

# eagle3 draft trees vs the chain at equal verified tokens, interleaved (docs/benchmarks.md)
bench-tree: venv
	$(BIN)/python -m loadtest.bench_tree $(ARGS)

bench-spec: venv
	$(BIN)/python -m loadtest.bench_spec $(ARGS)

# HF generate (plain / assisted / prompt lookup) vs our server at batch 1, same models, one run.
bench-baselines: venv
	$(BIN)/python -m loadtest.bench_baselines $(ARGS)

# The same comparison interleaved per prompt (every arm on each prompt back to back): for drifting VMs.
bench-paired: venv
	$(BIN)/python -m loadtest.bench_paired $(ARGS)

# Our server under different flags, batch 1, interleaved per prompt, against the engine without HTTP:
#   make bench-server-ab ARGS='--dtype bfloat16 --compile --config thread= --config process=--engine-process'
bench-server-ab: venv
	$(BIN)/python -m loadtest.bench_server_ab $(ARGS)

# Seeded (coupled) against unseeded (rejection) sampled speculation, batch 1, arms interleaved per prompt.
bench-coupled: venv
	$(BIN)/python -m loadtest.bench_coupled $(ARGS)

# Our n-gram vs vLLM's on the same target; vLLM in its own venv (VLLM_PYTHON=..., see loadtest/bench_vllm.py).
bench-vllm: venv
	$(BIN)/python -m loadtest.bench_vllm $(ARGS)

# The headline comparisons in one run: HF ratios at batch 1, ours vs vLLM n-gram, best method vs none at concurrency 16.
bench-report: venv
	$(BIN)/python -m loadtest.bench_report $(ARGS)

# On a CUDA machine: flash-attn vs SDPA equivalence + a short decode benchmark (< 5 minutes).
# On a CUDA machine: the CUDA attention tests (Triton kernel, and flash-attn when its optional extra installs)
# and loadtest.gpu_check's tables. `make gpu-check-run GPU_PY=python3` runs them with an interpreter that already
# holds torch and the package (no venv; for machines without a package registry).
GPU_PY ?= $(BIN)/python
gpu-check: venv
	$(BIN)/python -m pip install -q -e '.[gpu]' || echo "flash-attn did not install; Triton and SDPA paths only"
	$(MAKE) gpu-check-run

gpu-check-run:
	$(GPU_PY) -m pytest -q -p no:cacheprovider -m gpu tests/test_models_gpu.py
	$(GPU_PY) -m pytest -q -p no:cacheprovider tests/triton_cases.py
	$(GPU_PY) -m loadtest.gpu_check --device cuda --dtype bfloat16

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: fuzz soak flood

# Schemathesis against the server's own /openapi.json with many more examples than `make test` runs.
fuzz: venv
	SPECSERVE_FUZZ_EXAMPLES=$${SPECSERVE_FUZZ_EXAMPLES:-400} $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_schemathesis.py

# N minutes of mixed load with disconnects and bad requests (not in CI): leaked blocks, RSS growth, errors.
soak: venv
	$(BIN)/python -m loadtest.soak $(or $(ARGS),--tiny --minutes 20)

# p99 latency of normal requests with / without a flood of bad requests.
flood: venv
	$(BIN)/python -m loadtest.flood_latency $(or $(ARGS),--tiny)

# TP = 2 (gloo) vs TP = 1 on CPU, interleaved: tokens/s ratio and the collectives' share of a step.
bench-tp: venv
	$(BIN)/python -m loadtest.bench_tp $(ARGS)

bench-metrics: venv
	$(BIN)/python -m loadtest.bench_metrics $(ARGS)

# JSON-schema completions: grammar overhead without speculation, and each method's speedup with and without it.
bench-structured: venv
	$(BIN)/python -m loadtest.bench_structured $(ARGS)

# suffix and auto against the fixed methods on repeated, agentic, mixed and fresh workloads.
bench-auto: venv
	$(BIN)/python -m loadtest.bench_auto $(ARGS)

include training/Makefile.inc
