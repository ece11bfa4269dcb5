# Two commands do all set-up on a fresh machine: `make test` and `make demo`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0

.PHONY: test test-unit demo lint system-deps dashboards rules bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch; a plain `torch` requirement would pull a CUDA build of several GB.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

system-deps:
	./scripts/install-system-deps.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Two passes, the folder decides which: the tests outside tests/integration/, which start no
# real-time processes, on TEST_WORKERS workers (they use the cores), then tests/integration/
# (real Prometheus, ranks, timing; its conftest.py marks them `integration`) on
# INTEGRATION_WORKERS workers, whose waits on real time overlap: on 2 cores 3 keep both busy,
# 4 take as long (INTEGRATION_WORKERS=0 runs them one at a time). Workers take the longest
# modules first (tests/module_order.py, tests/module_seconds.json).
# Exit status 5 is "no test selected" (PYTEST_ARGS may name tests of one kind only).
# Each run in a new order (pytest-randomly), its seed in the command line make prints:
# `make test TEST_SEED=N` repeats an order.
TEST_WORKERS ?= 2
INTEGRATION_WORKERS ?= 3
ifndef TEST_SEED
TEST_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
PYTEST = $(VENV)/bin/pytest -q --dist loadfile --no-loadscope-reorder --durations=15 --randomly-seed=$(TEST_SEED)
UNIT = $(PYTEST) -n $(TEST_WORKERS) -m "not integration" $(PYTEST_ARGS)
INTEGRATION = $(PYTEST) -n $(INTEGRATION_WORKERS) -m integration $(PYTEST_ARGS)
test: $(STAMP) system-deps lint
	$(UNIT) || [ $$? -eq 5 ]
	$(INTEGRATION) || [ $$? -eq 5 ]

test-unit: $(STAMP) lint
	$(UNIT)

demo: $(STAMP) system-deps
	$(VENV)/bin/robust-metrics demo $(DEMO_ARGS)

dashboards: $(STAMP)
	$(VENV)/bin/robust-metrics dashboards --out dashboards/

rules: $(STAMP)
	$(VENV)/bin/robust-metrics rules --format prometheus-operator --out deploy/prometheusrule.yaml

bench: $(STAMP)
	for b in bench/*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache demo-run
