"""The test tree's own layout rules, read with ast:

- no test file imports a test module (`test_*.py`) or a conftest: shared builders live in tests/support/;
- a test's kind marker is where it launches processes (tests/support/launch_scan.py, which tests/conftest.py
  marks from): a kind written in a test file says what the test launches, and every process a test starts goes
  through a call the scan follows.

Each rule is also run on a synthetic source that breaks it, so a rule that stopped firing fails here.
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

from tests.support.launch_scan import (REPO, TESTS, Module, Scanner, is_test_module, load_modules, marker_for,
                                       marker_problems, parse_module, collected_tests, unfollowed_launches)


def _is_test_module_name(dotted: str) -> bool:
    last = dotted.split(".")[-1]
    return dotted.split(".")[0] == "tests" and (last.startswith("test_") or last == "conftest")


def _string_text(node: ast.AST):
    """A string constant's text; an f-string's with each {value} as None; else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "None" for part in node.values)
    return None


def imports_of_test_modules(tree: ast.AST):
    """(line, module) of every import in `tree` of a test module or a conftest, at any depth (function-level too),
    in line order."""
    found = []
    # an f-string's literal pieces are read once, as the whole string with each {value} taken as None
    in_fstrings = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
    for node in ast.walk(tree):
        if id(node) in in_fstrings:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: any import that names a test module
            names = [f"tests.{node.module or ''}.{alias.name}" for alias in node.names]
        elif _string_text(node) is not None and "import" in _string_text(node):
            # code a test runs in a child process (`python -c CODE`) imports too
            try:
                code = ast.parse(textwrap.dedent(_string_text(node)))
            except SyntaxError:
                continue
            found += [(node.lineno, name) for _, name in imports_of_test_modules(code)]
            continue
        else:
            continue
        for name in names:
            if _is_test_module_name(name):
                found.append((node.lineno, name))
                break
    return sorted(found)


def test_no_test_file_imports_another_test_module():
    found = [f"{path.relative_to(REPO)}:{line}: imports {name}"
             for path in sorted(TESTS.rglob("*.py")) if "__pycache__" not in path.parts
             and path != Path(__file__)  # this file's synthetic sources break the rule on purpose
             for line, name in imports_of_test_modules(ast.parse(path.read_text()))]
    assert not found, "move what they share into tests/support/:\n" + "\n".join(found)


def test_the_import_rule_fires_on_a_synthetic_source():
    source = ("from tests.e2e.test_faults_processes import FLAGS\n"
              "def helper():\n    import tests.models.test_qwen3_moe as moe\n"
              "from tests import conftest\nfrom tests.support.launchers import run_pretrain\n"
              "CHECK = \"\"\"\nimport torch\nfrom tests.kernels.test_gated_delta_rule import _grads\n\"\"\"\n"
              "CODE = f\"from tests.e2e.test_checkpoint_kill import job; job({str(path)!r})\"\n")
    assert [name for _, name in imports_of_test_modules(ast.parse(source))] == [
        "tests.e2e.test_faults_processes", "tests.models.test_qwen3_moe", "tests.conftest",
        "tests.kernels.test_gated_delta_rule", "tests.e2e.test_checkpoint_kill"]


def test_written_kinds_say_what_the_tests_launch():
    modules = load_modules()
    scanner = Scanner(modules)
    problems = [problem for module in modules.values() if is_test_module(module)
                for problem in marker_problems(scanner, module)]
    assert not problems, "remove the written marker (tests/conftest.py sets it) or fix it:\n" + "\n".join(problems)


def test_every_launch_goes_through_a_call_the_scan_follows():
    found = [line for module in load_modules().values() for line in unfollowed_launches(module)]
    assert not found, "launch through subprocess or tests.support.launchers instead:\n" + "\n".join(found)


def test_the_scan_reads_the_launches_of_the_real_tests():
    modules = load_modules()
    scanner = Scanner(modules)

    def kinds(module_name):
        module = modules[module_name]
        return {name: marker_for(scanner.node_kinds(module, node)) for name, node in collected_tests(module)}

    # torchrun and the entry point as subprocesses, through support helpers (issue 39: was marked unit)
    assert set(kinds("tests.e2e.test_faults_processes").values()) == {"e2e"}
    # a module-scoped fixture that runs the entry point makes each test using it e2e
    assert set(kinds("tests.parallel.test_mtp_parallel").values()) == {"e2e"}
    # gloo ranks through run_distributed, next to in-process tests in the same file
    parallel = kinds("tests.parallel.test_tensor_parallel")
    assert "distributed" in parallel.values() and "unit" in parallel.values(), parallel


def _synthetic(name: str, source: str) -> Module:
    return parse_module(name, REPO / "tests" / "e2e" / f"{name.split('.')[-1]}.py", source)


def test_the_marker_rules_fire_on_synthetic_sources():
    support = parse_module("tests.support.launchers", TESTS / "support" / "launchers.py",
                           (TESTS / "support" / "launchers.py").read_text())
    module = _synthetic("tests.e2e.test_synthetic", """
import subprocess
import pytest
from tests.support.launchers import run_distributed, run_pretrain

pytestmark = pytest.mark.unit

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_pretrain([], tmp_path_factory.mktemp("x"))

def _tool():
    return subprocess.run(["true"])

def test_through_a_fixture(trained):
    assert trained

def test_through_a_local_helper():
    _tool()

@pytest.mark.distributed
def test_ranks():
    run_distributed(print, 2)

@pytest.mark.e2e
def test_in_process():
    assert 1 + 1 == 2
""")
    scanner = Scanner({support.name: support, module.name: module})
    problems = marker_problems(scanner, module)
    assert [p.split("::")[1].split(" ")[0] for p in problems] == [
        "test_through_a_fixture", "test_through_a_local_helper", "test_in_process"], problems
    assert "marked unit but launches as e2e" in problems[0] and "marked e2e but launches as unit" in problems[2]
    unfollowed = _synthetic("tests.e2e.test_forks", "import os\nimport multiprocessing as mp\n"
                            "def test_fork():\n    os.fork()\n    mp.Pool(2)\n")
    assert [line.split(": ")[1] for line in unfollowed_launches(unfollowed)] == ["os.fork", "multiprocessing.Pool"]


def test_support_holds_no_tests():
    assert not [path for path in (TESTS / "support").glob("test_*.py")], "tests/support/ holds builders, not tests"
    assert Path(__file__).parent.name == "tools"
