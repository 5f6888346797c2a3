"""Test kinds, as markers, so a quick run is one command:

    python -m pytest -m unit tests            # in-process tests (a minute or two)
    python -m pytest -m distributed tests     # 2-rank gloo tests (mp.spawn)
    python -m pytest -m e2e tests             # the real entry point and tools as subprocesses (torchrun)

A test is `e2e` when its code (or a helper it names) starts the entry point or a tool as a subprocess,
`distributed` when it spawns gloo ranks, `unit` otherwise; an explicit marker in the test file wins.
"""
from __future__ import annotations

import inspect
import os
import sys

import pytest

# One intra-op thread per process, here and in every process a test starts (mp.spawn ranks, torchrun, tools inherit
# the variable): the models are tiny, so a second OpenMP thread buys nothing, and on the 2-core CI machine two ranks
# x two spinning threads oversubscribe it — measured on the qwen3_next reference loop, 8 steps took 18 s of CPU
# with 2 threads against 0.3 s with 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

KINDS = ("unit", "distributed", "e2e")
_E2E_WORDS = ("run_pretrain", "subprocess", "torch.distributed.run", "run_cli", "dry_run(", "train(")
_DISTRIBUTED_WORDS = ("run_distributed", "mp.spawn")


def pytest_configure(config):
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late for it
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    for kind, text in zip(KINDS, ("in-process test", "2-rank gloo test", "entry point / tool run as a subprocess")):
        config.addinivalue_line("markers", f"{kind}: {text}")


def _source(item) -> str:
    try:
        text = inspect.getsource(item.function)
    except (OSError, TypeError):
        return ""
    # fixtures the test uses may do the work (e.g. a module-scoped reference run)
    module = item.module
    for name in getattr(item, "fixturenames", ()):
        fixture = getattr(module, name, None)
        if fixture is not None and callable(fixture):
            try:
                text += inspect.getsource(getattr(fixture, "__wrapped__", fixture))
            except (OSError, TypeError):
                pass
    return text


def pytest_unconfigure(config):
    # The forkserver tests.support.launchers.run_distributed forks its ranks from: stopped and waited for, so that it goes
    # with the session and its CPU time is counted with the session's.
    if "multiprocessing.forkserver" in sys.modules:
        stop = getattr(sys.modules["multiprocessing.forkserver"]._forkserver, "_stop", None)
        if stop is not None:
            stop()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in KINDS):
            continue
        text = _source(item)
        if any(word in text for word in _E2E_WORDS):
            item.add_marker(pytest.mark.e2e)
        elif any(word in text for word in _DISTRIBUTED_WORDS):
            item.add_marker(pytest.mark.distributed)
        else:
            item.add_marker(pytest.mark.unit)
