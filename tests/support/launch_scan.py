"""Which tests launch processes, read from the test code itself (ast, nothing imported): the facts behind the test
kind markers (tests/conftest.py) and their check (tests/tools/test_test_layout.py).

A test launches `ranks` when it (or a function, fixture or support helper it calls, followed through the test
modules and tests/support/) forks gloo ranks (`torch.multiprocessing.start_processes` / `spawn`: what
`tests.support.launchers.run_distributed` does), and `process` when it starts a program (`subprocess.*`: the entry
point, torchrun, a tool). Calls into the project's own packages are the code under test and are not followed.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent

# The primitives a launch comes down to, by qualified name.
PROCESS_CALLS = frozenset({"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                           "subprocess.check_output", "os.system", "os.execv", "os.execvp", "os.spawnv"})
RANK_CALLS = frozenset({"torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
                        "multiprocessing.Process", "torch.multiprocessing.Process"})
# The marker each kind of launch asks for; a test that launches both kinds is `e2e`.
MARKER = {"process": "e2e", "ranks": "distributed"}
KINDS = ("unit", "distributed", "e2e")


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    defs: Dict[str, ast.AST] = field(default_factory=dict)  # top-level functions and classes
    imports: Dict[str, str] = field(default_factory=dict)  # local name -> qualified name (module or module.attr)


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def load_modules(root: Path = TESTS) -> Dict[str, Module]:
    modules = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts or "data" in path.relative_to(root).parts[:1]:
            continue
        modules[_module_name(path)] = parse_module(_module_name(path), path, path.read_text())
    return modules


def parse_module(name: str, path: Path, text: str) -> Module:
    module = Module(name, path, ast.parse(text))
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            module.defs[node.name] = node
    for node in ast.walk(module.tree):  # function-level imports too: tests import helpers where they use them
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    module.imports[alias.asname] = alias.name
                else:
                    module.imports[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                module.imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return module


def _qualified(module: Module, func: ast.expr) -> Optional[str]:
    parts: List[str] = []
    while isinstance(func, ast.Attribute):
        parts.insert(0, func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    if not parts and func.id in module.defs:
        return f"{module.name}.{func.id}"
    root = module.imports.get(func.id)
    return ".".join([root, *parts]) if root else None


def _fixture_names(node: ast.AST) -> Set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {a.arg for a in node.args.args + node.args.kwonlyargs}
    return set()


class Scanner:
    """Launch kinds of functions, followed through calls and fixtures across the scanned modules."""

    def __init__(self, modules: Dict[str, Module]):
        self.modules = modules
        self.conftest_fixtures = {name: (mod, node) for mod in modules.values() if mod.name.endswith("conftest")
                                  for name, node in mod.defs.items()}
        self._memo: Dict[str, Tuple[FrozenSet[str], FrozenSet[str]]] = {}

    def _resolve(self, qualified: str) -> Optional[Tuple[Module, ast.AST]]:
        module_name, _, attr = qualified.rpartition(".")
        module = self.modules.get(module_name)
        if module is not None and attr in module.defs:
            return module, module.defs[attr]
        return None

    def _direct(self, module: Module, node: ast.AST) -> Tuple[FrozenSet[str], FrozenSet[str]]:
        """(launch kinds `node` calls directly, qualified names of the helpers and fixtures it reaches)."""
        found: Set[str] = set()
        names: Set[str] = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                qualified = _qualified(module, sub.func)
                if qualified in PROCESS_CALLS:
                    found.add("process")
                elif qualified in RANK_CALLS:
                    found.add("ranks")
                elif qualified:
                    names.add(qualified)
            elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                qualified = _qualified(module, sub)  # a helper handed on (run_distributed(fn, 2), a fixture)
                if qualified:
                    names.add(qualified)
        for arg in _fixture_names(node):
            if arg in module.defs:
                names.add(f"{module.name}.{arg}")
            elif arg in module.imports:
                names.add(module.imports[arg])
            elif arg in self.conftest_fixtures:
                names.add(f"{self.conftest_fixtures[arg][0].name}.{arg}")
        return frozenset(found), frozenset(names)

    def node_kinds(self, module: Module, node: ast.AST) -> FrozenSet[str]:
        """The launch kinds of `node` (a function, class or whole module body) and of everything it reaches."""
        found, todo = self._direct(module, node)
        found, todo, seen = set(found), list(todo), set(todo)
        while todo:
            qualified = todo.pop()
            if qualified not in self._memo:
                target = self._resolve(qualified)
                self._memo[qualified] = self._direct(*target) if target else (frozenset(), frozenset())
            kinds, names = self._memo[qualified]
            found |= kinds
            for name in names - seen:
                seen.add(name)
                todo.append(name)
        return frozenset(found)


def marker_for(kinds: FrozenSet[str]) -> str:
    if "process" in kinds:
        return "e2e"
    if "ranks" in kinds:
        return "distributed"
    return "unit"


def is_test_module(module: Module) -> bool:
    return module.path.name.startswith("test_") and module.path.parent != TESTS / "support"


def collected_tests(module: Module):
    """(name, node) of the test functions and test methods of a test module."""
    for name, node in module.defs.items():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and name.startswith("test"):
            yield name, node
        elif isinstance(node, ast.ClassDef) and name.startswith("Test"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield f"{name}::{item.name}", item


def module_launches(scanner: Scanner, module: Module) -> str:
    """The marker a test module's launches ask for: the strongest over its tests (fixtures they use included)."""
    kinds: Set[str] = set()
    for _, node in collected_tests(module):
        kinds |= scanner.node_kinds(module, node)
    return marker_for(frozenset(kinds))


def declared_marker(module: Module) -> Optional[str]:
    """The kind a module declares with `pytestmark = pytest.mark.<kind>` (or a list holding one), else None."""
    for node in module.tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            for sub in ast.walk(node.value):
                if isinstance(sub, ast.Attribute) and sub.attr in KINDS and isinstance(sub.value, ast.Attribute) \
                        and sub.value.attr == "mark":
                    return sub.attr
    return None


def _kind_of_marks(decorators) -> Optional[str]:
    for node in decorators:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in KINDS and isinstance(sub.value, ast.Attribute) \
                    and sub.value.attr == "mark":
                return sub.attr
    return None


def declared_kinds(module: Module) -> Dict[str, str]:
    """{test name: kind} for the tests a kind is written for (on the test, its class or the module)."""
    module_kind = declared_marker(module)
    out = {}
    for name, node in collected_tests(module):
        kind = _kind_of_marks(node.decorator_list)
        if kind is None and "::" in name:
            kind = _kind_of_marks(module.defs[name.split("::")[0]].decorator_list)
        kind = kind or module_kind
        if kind:
            out[name] = kind
    return out


def marker_problems(scanner: Scanner, module: Module) -> List[str]:
    """Each test whose written kind is not what it launches: a launch without its marker, or a marker without
    the launch."""
    problems = []
    for name, declared in declared_kinds(module).items():
        node = dict(collected_tests(module))[name]
        launched = marker_for(scanner.node_kinds(module, node))
        if declared != launched:
            problems.append(f"{module.path.relative_to(REPO)}::{name} is marked {declared} but launches as "
                            f"{launched} ({'nothing' if launched == 'unit' else MARKER_WORDS[launched]})")
    return problems


MARKER_WORDS = {"e2e": "starts a program", "distributed": "forks gloo ranks"}
# Ways to start a process the scan does not follow: a test must launch through the calls above (the launchers).
UNFOLLOWED_CALLS = frozenset({"os.fork", "os.forkpty", "pty.spawn", "multiprocessing.Pool",
                              "multiprocessing.get_context", "concurrent.futures.ProcessPoolExecutor",
                              "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell", "os.popen"})


def unfollowed_launches(module: Module) -> List[str]:
    """Calls in `module` that start processes in a way the scan does not see (so no marker would follow them)."""
    out = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Call) and _qualified(module, node.func) in UNFOLLOWED_CALLS:
            out.append(f"{module.path.relative_to(REPO)}:{node.lineno}: {_qualified(module, node.func)}")
    return out
