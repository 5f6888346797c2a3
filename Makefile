# The two set-up commands a newcomer needs: `make demo` and `make test`. Each installs what it needs, at the
# versions CI last passed with (constraints-cpu.txt, the lock; `make lock` regenerates it on purpose).
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# CONSTRAINTS= (empty) installs the newest releases the ranges in setup.py allow (.ci/run's newest-releases check).
CONSTRAINTS ?= -c constraints-cpu.txt
PYTEST_ARGS ?=

.PHONY: install install-run test test-quick demo bench lock

# torch first: the CPU wheel (a plain `torch` requirement would fetch a CUDA build of several GB).
install-run:
	$(PIP) install -q $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q $(CONSTRAINTS) -e .

install: install-run
	$(PIP) install -q $(CONSTRAINTS) -e ".[test]"

# Two pytest workers (pytest-xdist): the tests' processes run one torch thread each (tests/conftest.py).
test: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 $(PYTEST_ARGS) tests

# The in-process unit tests only (a few minutes); CI runs the whole suite.
test-quick: install
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -n 2 -m unit $(PYTEST_ARGS) tests

demo: install-run
	HF_HUB_OFFLINE=1 PYTHON=$(PYTHON) bash examples/demo.sh

bench: install
	@for b in benchmarks/bench_*.py; do m=$$(basename $$b .py); echo "== $$m"; \
		HF_HUB_OFFLINE=1 $(PYTHON) -m benchmarks.$$m || exit 1; done

# Regenerates the lock from a fresh environment with the newest releases the ranges allow. Run it on purpose,
# then run `make test` and commit constraints-cpu.txt with the note of what changed.
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	$(MAKE) install PYTHON=.lock-venv/bin/python CONSTRAINTS=
	.lock-venv/bin/python -m pip freeze --exclude-editable | grep -v "^-e " > constraints-cpu.txt
	rm -rf .lock-venv
