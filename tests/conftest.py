"""Test kinds, as markers, so a quick run is one command:

    python -m pytest -m unit tests            # in-process tests (a minute or two)
    python -m pytest -m distributed tests     # 2-rank gloo tests (forked ranks: tests.support.launchers)
    python -m pytest -m e2e tests             # the real entry point and tools as subprocesses (torchrun)

A test's kind is where it launches processes, read from the code (tests/support/launch_scan.py): `e2e` when it, or
a fixture or helper it calls, starts a program (`subprocess`: the entry point, torchrun, a tool), `distributed`
when it forks gloo ranks (`run_distributed`), `unit` otherwise. A kind written in a test file
(`pytestmark = pytest.mark.e2e`) is kept, and tests/tools/test_test_layout.py checks that it says what the test does.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread per process, here and in every process a test starts (mp.spawn ranks, torchrun, tools inherit
# the variable): the models are tiny, so a second OpenMP thread buys nothing, and on the 2-core CI machine two ranks
# x two spinning threads oversubscribe it — measured on the qwen3_next reference loop, 8 steps took 18 s of CPU
# with 2 threads against 0.3 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("unit", "distributed", "e2e")


def pytest_configure(config):
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for kind, text in zip(KINDS, ("in-process test", "2-rank gloo test", "entry point / tool run as a subprocess")):
        config.addinivalue_line("markers", f"{kind}: {text}")


def pytest_unconfigure(config):
    # The forkserver tests.support.launchers.run_distributed forks its ranks from: stopped and waited for, so that it
    # goes with the session and its CPU time is counted with the session's.
    if "multiprocessing.forkserver" in sys.modules:
        stop = getattr(sys.modules["multiprocessing.forkserver"]._forkserver, "_stop", None)
        if stop is not None:
            stop()


def pytest_collection_modifyitems(config, items):
    from tests.support.launch_scan import Scanner, load_modules, marker_for, collected_tests

    modules = load_modules()
    by_path = {module.path: module for module in modules.values()}
    scanner = Scanner(modules)
    tests = {}
    for item in items:
        if any(item.get_closest_marker(kind) for kind in KINDS):
            continue
        module = by_path.get(Path(str(item.path)).resolve())
        if module is None:
            item.add_marker(pytest.mark.unit)
            continue
        if module.name not in tests:
            tests[module.name] = dict(collected_tests(module))
        name = getattr(item, "originalname", None) or item.name
        if item.cls is not None:
            name = f"{item.cls.__name__}::{name}"
        node = tests[module.name].get(name)
        kind = marker_for(scanner.node_kinds(module, node)) if node is not None else "unit"
        item.add_marker(getattr(pytest.mark, kind))
