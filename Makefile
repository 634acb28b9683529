# Every target does its own set-up on a fresh machine: venv, install, models, corpus.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
SIDECAR_HOME ?= $(HOME)/.cache/sidecar
export SIDECAR_HOME
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

# A CPU machine gets the CPU build of torch from local disk; a CUDA machine the normal CUDA build.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.13,<3' || echo 'torch==2.13.0')

.PHONY: venv models corpus browser postgres test test-fast demo ui bench bench-quick bench-full gpu-check llama-cpp lint clean

# infra/install.py: uv fed pip's own configuration (pip where it cannot be), with bytecode compiled as pip does
$(BIN)/sidecar: pyproject.toml infra/install.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python infra/install.py '$(TORCH_SPEC)' -e '.[dev]'
	touch $@

venv: $(BIN)/sidecar

models: venv
	$(BIN)/sidecar models fetch --pair qwen-coder-small

corpus: data/news.parquet

data/news.parquet: $(BIN)/sidecar
	$(BIN)/sidecar corpus build --out $@

CODE := sidecar storage pipeline server study flows cli vocab tests bench infra

# ruff, then the layer contracts of pyproject.toml ([tool.importlinter])
lint: venv
	$(BIN)/ruff check $(CODE)
	$(BIN)/lint-imports

# Headless Chromium and its driver for tests/test_report_browser.py and tests/test_ui.py's run form: installed
# where we are root with apt-get (CI), left alone elsewhere, where the browser tests skip and say why.
browser:
	@if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
		&& command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; \
	fi

# PostgreSQL's server for tests/test_deployments_postgres.py (a Prefect server keeping its state in Postgres, as
# infra/docker-compose.yml runs it): installed where we are root with apt-get (CI), left alone elsewhere, where
# those tests skip and say why. Debian keeps its binaries in /usr/lib/postgresql/<version>/bin.
postgres:
	@if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
		&& command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null; \
	fi

# pytest processes (pytest-xdist): most tests use one core (the tiny pair on one torch thread); a module's
# tests stay in one process, so its fixtures (a Prefect server, a loaded pair) are made once; the longest
# modules are handed out first (tests/conftest.py, module_rank), in that order: xdist's default reorders the
# modules by their number of tests, which handed the real pair's (3 tests, the longest) out midway, and it
# ran on alone at the end
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# keeps what a run found under test-artifacts/: junit.xml (each test's outcome and seconds) and durations.txt
# (every test's setup, call and teardown seconds, slowest first); the terminal lists the 15 slowest
test: lint browser postgres models corpus
	$(PYTEST) -rs --durations=15 --junitxml=test-artifacts/junit.xml --durations-file=test-artifacts/durations.txt

# no real pair, no slow test and nothing that starts a server or a process (`servers`, tests/servers.py): an
# unmarked test that starts one fails here saying so
test-fast: venv
	$(PYTEST) -m "not real and not slow and not servers"

demo: models corpus
	$(BIN)/sidecar demo --corpus data/news.parquet --limit 4 --db data/sidecar.duckdb

# a local Prefect server with its UI, the deployments of prefect.yaml and a worker, until Ctrl-C
ui: models corpus
	$(BIN)/sidecar ui

# a benchmark refuses a checkout with uncommitted changes: BENCH_ARGS=--allow-dirty measures it anyway (and says so)
BENCH_ARGS ?=
bench: models corpus
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

bench-quick: models corpus
	$(BIN)/python -m bench.run_all --quick $(BENCH_ARGS)

bench-full: models corpus
	$(BIN)/python -m bench.run_all --full $(BENCH_ARGS)

# Optional, for bench/llama_cpp.py only (no other target needs it): llama-cpp-python built once from its sdist,
# as its prebuilt wheels need a newer glibc than some machines have, and for this machine's CPU (GGML_NATIVE),
# less AMX: on a Xeon with AMX, 0.3.36's AMX path crashed in its first decode of the Q4_K_M target. No llava
# (unused). The wheel is kept under $(SIDECAR_HOME)/wheels, so a second run only installs it; the build took
# 6-8 min on 2 shared cores (22 min with llava, under heavier load).
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_WHEELS := $(SIDECAR_HOME)/wheels
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llama-cpp: venv
	@if ! ls $(LLAMA_CPP_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
		CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF "-DCMAKE_C_FLAGS=$(NO_AMX)" "-DCMAKE_CXX_FLAGS=$(NO_AMX)"' \
		CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m pip wheel --no-deps --no-binary llama-cpp-python \
			-w $(LLAMA_CPP_WHEELS) 'llama-cpp-python==$(LLAMA_CPP_VERSION)'; \
	fi
	$(BIN)/python -m pip install -q $(LLAMA_CPP_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl

# on a GPU: step costs, capture modes, host floors, identity, syncs, SDPA kernels, peak memory and tokens/s within
# 8 minutes (bench/gpu_check/).
# Without a venv, where python3 has torch and transformers (a lent GPU machine: no network, so no venv, models or
# corpus; a copy of the tree, no git checkout), that python3 runs it, on the pairs on disk (else synthetic and tiny
# ones) and built-in texts; the caller names the clean commit it copied: SIDECAR_BENCH_COMMIT=<sha> make gpu-check.
# GPU_CHECK_ARGS passes options (python -m bench.gpu_check --help).
gpu-check:
	@if [ ! -x $(BIN)/python ] && $(PY) -c 'import torch, transformers' 2>/dev/null; then \
		echo "gpu-check: no venv; $(PY) has torch and transformers: running with it"; \
		$(PY) -m bench.gpu_check $(GPU_CHECK_ARGS); \
	else \
		$(MAKE) --no-print-directory models corpus && $(BIN)/python -m bench.gpu_check $(GPU_CHECK_ARGS); \
	fi

clean:
	rm -rf $(VENV) .prefect data/*.duckdb
