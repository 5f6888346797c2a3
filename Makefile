# The two set-up commands a newcomer needs: `make demo` and `make test`. Each installs what it needs.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: install test demo bench

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"

test: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q tests

demo: install
	HF_HUB_OFFLINE=1 bash examples/demo.sh

bench: install
	@for b in benchmarks/bench_*.py; do echo "== $$b"; HF_HUB_OFFLINE=1 $(PYTHON) $$b || exit 1; done
