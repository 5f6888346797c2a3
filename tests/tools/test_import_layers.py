"""The layers the code keeps, read from its own imports (module-level and inside functions alike).

A module may import its own layer and the layers below it, never one above (the table below, high to low; the
README's "Where things live" shows the same). The stricter rules: model code never sees a mesh or probes the
device (from `distributed` only the DTensor unwrap and rank-0 printing), the op library imports nothing of the
engine, and validation imports no torch and no runtime package. Files import each other in no loop at module
level. A test that fails names the file, the line and the rule.
"""
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# High to low: (layer, module prefixes). The longest matching prefix decides a module's layer.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("entry", ("pretrain_fsdp2", "tools", "fsdp2_backend.launch", "fsdp2_backend.cli")),
    # the two ways in: Megatron's flags, and the native config's loading and validation (every config module
    # but the values and facts listed under base)
    ("front", ("megatron_compat.parse", "megatron_compat.translate",
               "megatron_compat.architecture", "fsdp2_backend.config")),
    ("assembly", ("fsdp2_backend.build", "fsdp2_backend.inference")),
    ("engine", ("fsdp2_backend.training", "fsdp2_backend.parallel", "fsdp2_backend.data")),
    # the files a run reads and writes: Megatron's data and checkpoints, and our checkpoint layer
    ("formats", ("megatron_compat.data", "megatron_compat.checkpoint", "fsdp2_backend.checkpoint")),
    ("models", ("fsdp2_backend.models",)),
    ("distributed", ("fsdp2_backend.distributed",)),
    ("kernels", ("fsdp2_backend.kernels",)),
    # what every layer reads: the config's values and torch-free facts, the error type, the package itself
    ("base", ("fsdp2_backend.usage_errors", "fsdp2_backend.known_noise",
              *(f"fsdp2_backend.config.{name}" for name in (
                  "schema", "schema_training", "fields", "layout",  # the Config and its derived parallel sizes
                  "batch_schedule", "signal_names", "tp_cp_checks", "quant_names",  # facts validation and runtime share
                  "weight_files", "mup_rules")))),  # an HF directory's files; µP's multipliers (models read them)
]
# A package's own __init__ (imported before any of its modules) sits where its values do, not where its prefix does.
PACKAGES = {"fsdp2_backend": "base", "fsdp2_backend.config": "base", "megatron_compat": "front"}
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}

# (importing module, imported module): why it may look up. Few, each with its way out.
EXCEPTIONS: Dict[Tuple[str, str], str] = {
    ("megatron_compat.checkpoint.mla", "megatron_compat.architecture.saved_args"):
        "an MLA checkpoint's saved args map to DeepSeek-V3 keys through the flags' own mapping (one place, lazily); "
        "that torch-free mapping belongs below the formats, or the checkpoint's config is made by its callers",
}

# What model code may take from `distributed`: tensor-level helpers that know no mesh and no device.
MODELS_MAY_USE = ("fsdp2_backend.distributed.dtensor", "fsdp2_backend.distributed.console")
# The op library stands alone: itself and the error type.
KERNELS_MAY_USE = ("fsdp2_backend.kernels", "fsdp2_backend.usage_errors", "fsdp2_backend")
OURS = ("fsdp2_backend", "megatron_compat")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> Dict[str, Path]:
    files = [REPO / "pretrain_fsdp2.py", *sorted((REPO / "tools").glob("*.py"))]
    for package in OURS:
        files += [p for p in sorted((REPO / package).rglob("*.py")) if "__pycache__" not in p.parts]
    return {_module_name(p): p for p in files}


SOURCES = _sources()


def _is_package(module: str) -> bool:
    return SOURCES.get(module, Path()).name == "__init__.py"


def _target(module: str, node: ast.AST, alias: str) -> Optional[str]:
    """The project module an import names (the submodule for `from pkg import submodule`), or None."""
    if isinstance(node, ast.Import):
        name = alias
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if _is_package(module) else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        name = f"{base}.{alias}" if f"{base}.{alias}" in SOURCES else base
    if not name.split(".")[0] in OURS:
        return None
    while name not in SOURCES and "." in name:  # `import a.b.c` of a name inside a module
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> Iterator[Tuple[str, int, bool]]:
    """(imported project module, line, at module level) for every import in `module`'s file."""
    tree = ast.parse(SOURCES[module].read_text(), filename=str(SOURCES[module]))

    def walk(node: ast.AST, top: bool) -> Iterator[Tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    target = _target(module, child, alias.name)
                    if target is not None:
                        yield target, child.lineno, top
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from walk(child, False)  # never executed: a type-checker's import, not a dependency
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from walk(child, top and not inner)

    yield from walk(tree, True)


def layer_of(module: str) -> str:
    if module in PACKAGES:
        return PACKAGES[module]
    best = max((prefix for _, prefixes in LAYERS for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=len, default=None)
    assert best is not None, f"{module}: in no layer — add it to LAYERS in {__file__}"
    return next(name for name, prefixes in LAYERS if best in prefixes)


def _edges() -> Iterator[Tuple[str, str, int, bool]]:
    for module in SOURCES:
        for target, line, top in _imports(module):
            if target != module:
                yield module, target, line, top


EDGES = list(_edges())


def _where(module: str, line: int) -> str:
    return f"{SOURCES[module].relative_to(REPO)}:{line}"


def test_every_module_has_a_layer():
    for module in SOURCES:
        layer_of(module)


def test_no_import_from_a_higher_layer():
    wrong, used = [], set()
    for module, target, line, _ in EDGES:
        if RANK[layer_of(target)] >= RANK[layer_of(module)]:
            continue
        if (module, target) in EXCEPTIONS:
            used.add((module, target))
            continue
        wrong.append(f"{_where(module, line)}: {module} ({layer_of(module)}) imports {target} "
                     f"({layer_of(target)}, a higher layer)")
    assert not wrong, "\n".join(wrong)
    stale = set(EXCEPTIONS) - used
    assert not stale, f"exceptions no longer needed, remove them from EXCEPTIONS: {sorted(stale)}"


def test_models_know_no_mesh_and_probe_no_device():
    wrong = [f"{_where(m, line)}: {m} imports {t} — model code takes the device and the groups from the build step"
             for m, t, line, _ in EDGES if layer_of(m) == "models" and layer_of(t) == "distributed"
             and not t.startswith(MODELS_MAY_USE)]
    assert not wrong, "\n".join(wrong)


def test_the_op_library_stands_alone():
    wrong = [f"{_where(m, line)}: {m} imports {t} — kernels import only kernels and usage_errors"
             for m, t, line, _ in EDGES if layer_of(m) == "kernels"
             and not (t in KERNELS_MAY_USE or t.startswith("fsdp2_backend.kernels."))]
    assert not wrong, "\n".join(wrong)


def test_no_import_loops_between_files():
    graph: Dict[str, set] = {module: set() for module in SOURCES}
    for module, target, _, top in EDGES:
        if top:
            graph[module].add(target)
    # Tarjan's strongly connected components: a component of two or more files is a loop.
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    loops: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in graph:
        if node not in index:
            visit(node)
    assert not loops, "module-level import loops:\n" + "\n".join(" <-> ".join(loop) for loop in loops)


def test_validation_imports_no_torch_and_no_runtime():
    code = ("import sys, fsdp2_backend.config.validation, fsdp2_backend.config.loading; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in ("
            "['fsdp2_backend', 'training'], ['fsdp2_backend', 'parallel'], ['fsdp2_backend', 'models'], "
            "['fsdp2_backend', 'data'], ['fsdp2_backend', 'build'])))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_rules_catch_a_wrong_import():
    """The checks see what they must: a function-level import is an edge, and a models → training import is
    placed above models."""
    assert layer_of("fsdp2_backend.training.trainer") == "engine" and layer_of("fsdp2_backend.models.mup") == "models"
    assert RANK["engine"] < RANK["models"] < RANK["kernels"]
    lazy = [(t, top) for m, t, _, top in EDGES if m == "fsdp2_backend.config.model_facts"
            and t == "megatron_compat.checkpoint.resume"]
    assert lazy == [("megatron_compat.checkpoint.resume", False)], lazy
