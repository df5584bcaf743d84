# Two commands matter: `make serve` and `make test` (`make unit` for the pure tests alone). Each
# creates .venv and installs what it needs. Each role has its own install into the same .venv, none
# but the server's with torch: `make client` (the client and what the README's examples import),
# `make operator-dev` (the operator and its offline preview).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# torch is pinned and installed first, alone: an unpinned torch pulls gigabytes of CUDA wheels.
TORCH  := torch==2.13.0
PROTO_OUT := server/kembed/v1/embedder_pb2.py

.PHONY: serve client operator-dev test lint typecheck unit proto bench bench-fleet clean env-table crds monitoring image image-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.serve: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[server,proto]"
	touch $@

$(VENV)/.client: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[client,examples]"
	touch $@

$(VENV)/.operator-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[operator,preview]"
	touch $@

$(VENV)/.proto: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e ".[proto]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.serve
	$(BIN)/pip install -q -e ".[server,client,parquet,proto,operator,bench,test]"
	touch $@

# grpcio-tools alone: the client's install needs the generated code too, and no torch.
$(PROTO_OUT): protos/kembed/v1/embedder.proto | $(VENV)/.proto
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=server --pyi_out=server \
	    --grpc_python_out=server protos/kembed/v1/embedder.proto

proto: $(PROTO_OUT)

# auto's verdicts (dtype, forward) and torch's compile caches, kept across restarts of make serve
# (docs/configuration.md#the-dtype); `KEMBED_COMPILE_CACHE_DIR= make serve` keeps none.
KEMBED_COMPILE_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kembed

serve: $(VENV)/.serve $(PROTO_OUT)
	KEMBED_COMPILE_CACHE_DIR='$(KEMBED_COMPILE_CACHE_DIR)' $(BIN)/python -m kembed

# The client library and commands, and what the README's Python block imports (openai, langchain-openai).
client: $(VENV)/.client $(PROTO_OUT)

# `python -m kembed_operator.preview` and the chart's offline render (docs/operator.md).
operator-dev: $(VENV)/.operator-dev

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.test $(PROTO_OUT)
	$(BIN)/mypy

# The pure tests, in minutes: every test but those marked `process` (a server, `kopf run`, a
# subprocess), and no process started (tests/lanes.py refuses one).
unit: $(VENV)/.test $(PROTO_OUT)
	$(BIN)/python -m pytest -m "not process and not image" $(PYTEST_ARGS)

# Every test (what .ci/run calls); the 30 slowest steps listed at the end.
test: lint typecheck
	$(BIN)/python -m pytest --durations=30 $(PYTEST_ARGS)

bench: $(VENV)/.test $(PROTO_OUT)
	$(BIN)/python -m bench.run_all

# About 42 minutes: a fleet of servers scaled by six autoscaling policies in turn (bench/fleet/).
bench-fleet: $(VENV)/.test $(PROTO_OUT)
	$(BIN)/python -m bench.fleet

# The CRDs in crds/ and the chart's crds/, generated from the operator's spec models.
crds: $(VENV)/.test
	$(BIN)/python -m kembed_operator.crd

# The chart's Grafana dashboard and alert rules (charts/kembed-operator/monitoring/), generated from
# the metric names the server exports (kembed.contract).
monitoring: $(VENV)/.test
	$(BIN)/python -m kembed_operator.monitoring

# The server (CPU) and operator images, built with buildah (docs/images.md): a Debian base from
# mmdebstrap where no registry answers, this machine's pip settings carried in as build secrets.
image:
	$(PYTHON) -m images.build

# Starts what `make image` built, with podman, and installs the client's extra in a fresh venv:
# never part of `make test`.
image-test: image $(VENV)/.test $(PROTO_OUT)
	$(BIN)/python -m pytest -m image tests/image $(PYTEST_ARGS)

env-table: $(VENV)/.serve
	$(BIN)/python -m kembed --env-table

clean:
	rm -rf $(VENV) $(PROTO_OUT) server/kembed/v1/*_pb2*
