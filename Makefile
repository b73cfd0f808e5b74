# The README names these targets; CI runs `make test` through .ci/run.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
KEDA_BUILD_LOG := .keda-build.log
GO_BUILD_LOG := .go-build.log
# The Go binaries the unit tier runs (tests/test_chart.py: helm template and lint, promtool
# check rules); e2e.harness.binaries builds them first.
UNIT_TIER_BINARIES := helm promtool

# Reinstall only when pyproject.toml (or the S3 test store's pins) changes: the stamp carries
# their checksum.
STAMP = $(VENV)/.installed-$(1)-$(shell cat pyproject.toml tests/requirements-s3.txt | sha1sum | cut -c1-12)

.PHONY: help venv install-server install-dev run test check lint unit e2e binaries build-images images bench gpu-smoke cluster-up cluster-down clean

help: ## List the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(call STAMP,server): | $(PY)
	$(PIP) install -q -e ".[server]"
	touch $@

$(call STAMP,dev): | $(PY)
	$(PIP) install -q -e ".[server,operator,test,dev]"
	@# moto, the unit tests' S3 store, beside the extras and not in them: its botocore and the
	@# extras' kubernetes cannot be resolved together (tests/requirements-s3.txt says why).
	$(PIP) install -q --no-deps -r tests/requirements-s3.txt
	touch $@

venv: $(call STAMP,dev) ## Create .venv with everything installed

run: $(call STAMP,server) ## Serve the packaged all-MiniLM-L6-v2 on http://127.0.0.1:8000
	$(VENV)/bin/embedding-server serve --host $(HOST) --port $(PORT)

test: ## Lint, unit tests, then e2e tests on a real local cluster (needs root)
	@# The Go builds are most of a cold run's CPU, and only the e2e tier needs all of them. They
	@# start at once in the background (e2e.harness.binaries is the standard library only, so
	@# $(PYTHON) runs it before the venv exists), niced all the way, so that the venv install,
	@# the image builds, lint and the unit tests (which leave a core idle, and time a few
	@# things) go first, as they would alone, and the builds take every cycle those leave.
	@# KEDA, the longest (its scalers pull in every cloud SDK), builds in a second process;
	@# both share one Go build cache.
	nice -n 19 $(PYTHON) -m e2e.harness.binaries --except keda > $(GO_BUILD_LOG) 2>&1 &
	nice -n 19 $(PYTHON) -m e2e.harness.binaries keda > $(KEDA_BUILD_LOG) 2>&1 &
	$(MAKE) build-images
	$(MAKE) lint
	@# Waits for the background build of these (built first), or builds them, failing with
	@# the error: the unit tier must not skip the tests that run them.
	$(PYTHON) -m e2e.harness.binaries $(UNIT_TIER_BINARIES)
	$(MAKE) unit PYTEST_ARGS="--durations=15 $(PYTEST_ARGS)"
	@# Waits for the background builds in turn (building whatever one of them failed, failing
	@# with the error) and empties the Go build cache, then prints the builds' logs.
	@$(MAKE) binaries; rc=$$?; \
	sed 's/^/[go, background] /' $(GO_BUILD_LOG); sed 's/^/[keda, background] /' $(KEDA_BUILD_LOG); \
	exit $$rc
	$(MAKE) e2e PYTEST_ARGS="--durations=30 $(PYTEST_ARGS)"

check: $(call STAMP,dev) ## The fast gate: lint and unit tests, no builds and no cluster
	$(MAKE) lint
	$(MAKE) unit

lint: $(call STAMP,dev) ## ruff, mypy, the import contracts and the docs site (strict links)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir .docs-site

unit: $(call STAMP,dev) ## Fast tests: no cluster, no network
	$(PY) -m pytest tests $(PYTEST_ARGS)

e2e: $(call STAMP,dev) binaries ## Tests against a real local Kubernetes cluster (needs root)
	$(PY) -m pytest e2e -m e2e $(PYTEST_ARGS)

binaries: $(call STAMP,dev) ## Build (or reuse from ~/.cache) the cluster's Go binaries (e2e/versions.env)
	$(PY) -m e2e.harness.binaries

build-images: $(call STAMP,dev)
	$(PY) -m e2e.harness.images build

images: $(call STAMP,dev) ## Build the container images from a local Debian base; load them into .cluster/ if up
	$(PY) -m e2e.harness.images build
	@if [ -f .cluster/state.json ]; then $(PY) -m e2e.harness.images load --cluster-state .cluster/state.json; fi

# infinity-emb pins its own torch and friends: it gets a virtualenv of its own, never .venv.
INFINITY_VENV := bench/out/infinity-venv

$(INFINITY_VENV)/bin/python:
	$(PYTHON) -m venv $(INFINITY_VENV)
	$(INFINITY_VENV)/bin/pip install -q 'infinity-emb[all]' || echo "infinity-emb did not install: the HTTP benchmark says so and runs without it"

bench: $(call STAMP,dev) binaries $(INFINITY_VENV)/bin/python ## Benchmarks against sentence-transformers and peers (ratios; figures in bench/out/*.json)
	$(PY) -m bench.offline --texts 200 --quantization int8 --infinity-python $(INFINITY_VENV)/bin/python
	$(PY) -m bench.shape_grid
	$(PY) -m bench.images --images 128
	$(PY) -m bench.generic --texts 200
	$(PY) -m bench.http_load --texts 256 --infinity-python $(INFINITY_VENV)/bin/python
	$(PY) -m bench.tensor_parallel --texts 200
	@command -v wrk >/dev/null || apt-get install -y -q wrk
	$(PY) -m bench.frontend --infinity-python $(INFINITY_VENV)/bin/python
	$(PY) -m bench.cold_start --against f148416
	$(PY) -m bench.bulk
	$(PY) -m bench.operator_scale

gpu-smoke: $(call STAMP,dev) ## On a GPU host: every attention kernel, dtype and model family vs float32 (exit 1 on a miss)
	$(PY) -m bench.gpu_smoke

cluster-up: $(call STAMP,dev) binaries ## Start the local cluster (a real node, fake GPU nodes, images loaded); prints the exports
	@$(PY) -m e2e.harness.cluster up

cluster-down: ## Stop the local control plane
	@$(PY) -m e2e.harness.cluster down

clean: cluster-down ## Remove the venv and caches (keeps ~/.cache binaries)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .docs-site $(KEDA_BUILD_LOG) $(GO_BUILD_LOG)
