"""The layer test's checker (tests/tools/test_import_layers.py), as functions over a source dict (module → text),
so that the test can feed each rule a made-up tree that breaks it.

`read_sources` reads the repository's modules; `import_edges` lists every import of a project module by another
with where it runs ("module": on import, "function": inside a function, when called, "typing": never, under
TYPE_CHECKING). A `Rules` holds the layer tables (high to low, the longest matching prefix decides a module's
layer) and checks the edges: imports of a higher layer, model code seeing a mesh, the op library importing the
engine, modules placed apart from their package's layer (`reclassified`); `torch_distributed_uses` finds every
spelling of torch.distributed in a file and `import_loops` the circles through the given kinds of import.
"""
import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple


@dataclass(frozen=True)
class Source:
    path: str  # as messages name it
    text: str
    is_package: bool = False  # a package's __init__


@dataclass(frozen=True)
class Edge:
    module: str
    target: str
    line: int
    kind: str  # "module" (runs on import), "function" (inside a function: runs when called), "typing" (never)


def read_sources(repo: Path, ours: Tuple[str, ...]) -> Dict[str, Source]:
    files = [repo / "pretrain_fsdp2.py", *sorted((repo / "tools").glob("*.py"))]
    for package in ours:
        files += [p for p in sorted((repo / package).rglob("*.py")) if "__pycache__" not in p.parts]
    sources = {}
    for path in files:
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        sources[".".join(parts)] = Source(str(path.relative_to(repo)), path.read_text(), path.name == "__init__.py")
    return sources


def _target(sources: Dict[str, Source], ours, module: str, node: ast.AST, alias: str) -> Optional[str]:
    """The project module an import names (the submodule for `from pkg import submodule`), or None."""
    if isinstance(node, ast.Import):
        name = alias
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if sources[module].is_package else module.split(".")[:-1]
            package = package[:len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        name = f"{base}.{alias}" if f"{base}.{alias}" in sources else base
    if not name.split(".")[0] in ours:
        return None
    while name not in sources and "." in name:  # `import a.b.c` of a name inside a module
        name = name.rsplit(".", 1)[0]
    return name


def import_edges(sources: Dict[str, Source], ours: Tuple[str, ...]) -> List[Edge]:
    """Every import of a project module by another, with where it runs."""
    edges = []

    def walk(module: str, node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for alias in child.names:
                    target = _target(sources, ours, module, child, alias.name)
                    if target is not None and target != module:
                        edges.append(Edge(module, target, child.lineno, kind))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                walk(module, child, "typing")  # never executed: a type-checker's import, not a dependency
            else:
                inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                walk(module, child, "function" if inner and kind == "module" else kind)

    for module, source in sources.items():
        walk(module, ast.parse(source.text, filename=source.path), "module")
    return edges


def _prefix_layer(module: str, layers) -> Optional[str]:
    best = max((prefix for _, prefixes in layers for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), key=len, default=None)
    return None if best is None else next(name for name, prefixes in layers if best in prefixes)


@dataclass(frozen=True)
class Rules:
    """The layer tables (see the layer test) and the checks over import edges."""

    layers: List[Tuple[str, Tuple[str, ...]]]
    packages: Dict[str, str]  # a package's __init__ → its layer
    models_may_use: Tuple[str, ...] = ()  # what model code may take from `distributed`
    kernels_may_use: Tuple[str, ...] = ()

    def layer_of(self, module: str) -> str:
        if module in self.packages:
            return self.packages[module]
        layer = _prefix_layer(module, self.layers)
        assert layer is not None, f"{module}: in no layer — add it to LAYERS in tests/tools/test_import_layers.py"
        return layer

    def upward_imports(self, sources, edges: Iterable[Edge]) -> List[str]:
        """Imports of a higher layer."""
        rank = {name: i for i, (name, _) in enumerate(self.layers)}
        wrong = []
        for e in edges:
            here, there = self.layer_of(e.module), self.layer_of(e.target)
            if rank[there] >= rank[here]:
                continue
            wrong.append(f"{sources[e.module].path}:{e.line}: {e.module} ({here}) imports {e.target} ({there}, a "
                         f"higher layer)")
        return wrong

    def models_seeing_a_mesh(self, sources, edges: Iterable[Edge]) -> List[str]:
        return [f"{sources[e.module].path}:{e.line}: {e.module} imports {e.target} — model code takes the device and "
                f"the groups from the build step" for e in edges
                if self.layer_of(e.module) == "models" and self.layer_of(e.target) == "distributed"
                and not e.target.startswith(self.models_may_use)]

    def kernels_importing_the_engine(self, sources, edges: Iterable[Edge]) -> List[str]:
        return [f"{sources[e.module].path}:{e.line}: {e.module} imports {e.target} — kernels import only kernels and "
                f"usage_errors" for e in edges if self.layer_of(e.module) == "kernels"
                and not (e.target in self.kernels_may_use or e.target.startswith("fsdp2_backend.kernels."))]

    def reclassified(self, sources: Dict[str, Source]) -> List[str]:
        """Modules placed in a layer other than their package's: only into base, and only torch-free ones (facts
        every layer reads); a module moved anywhere else to make the other rules pass is reported."""
        wrong = []
        for layer, prefixes in self.layers:
            for prefix in prefixes:
                if prefix not in sources and not any(m.startswith(prefix + ".") for m in sources):
                    wrong.append(f"{prefix}: in LAYERS but no such module or package")
                    continue
                parent = prefix.rsplit(".", 1)[0] if "." in prefix else None
                others = [(name, tuple(p for p in ps if p != prefix)) for name, ps in self.layers]
                own = _prefix_layer(parent, others) if parent else None
                if own is None or own == layer:
                    continue
                if layer != "base":
                    wrong.append(f"{prefix}: placed in {layer}, apart from its package's layer ({own})")
                elif prefix in sources and _imports_torch(sources[prefix]):
                    wrong.append(f"{sources[prefix].path}: placed in base (torch-free facts) but imports torch")
        return wrong


def _imports_torch(source: Source) -> bool:
    for node in ast.walk(ast.parse(source.text, filename=source.path)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def _is_torch_distributed(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def torch_distributed_uses(source: Source) -> List[str]:
    """Every import of torch.distributed (any spelling), `torch.distributed.*` attribute and use of a name bound to
    it (`dist.all_reduce` after `import torch.distributed as dist`), as "path:line: what"."""
    tree = ast.parse(source.text, filename=source.path)
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_torch_distributed(alias.name):
                    found.append((node.lineno, f"import {alias.name}"))
                    if alias.asname:
                        aliases.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if _is_torch_distributed(node.module):
                found.append((node.lineno, f"from {node.module} import ..."))
            elif node.module == "torch":
                for alias in node.names:
                    if alias.name == "distributed":
                        found.append((node.lineno, "from torch import distributed"))
                        aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr == "distributed":
                found.append((node.lineno, "torch.distributed"))
            elif node.value.id in aliases:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return [f"{source.path}:{line}: {what}" for line, what in sorted(found)]


def import_loops(edges: Iterable[Edge], kinds: Tuple[str, ...]) -> List[List[str]]:
    """Files that import each other in a circle (Tarjan's strongly connected components of two or more) through
    imports of the given kinds."""
    graph: Dict[str, set] = {}
    for e in edges:
        graph.setdefault(e.module, set())
        graph.setdefault(e.target, set())
        if e.kind in kinds:
            graph[e.module].add(e.target)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: set = set()
    loops: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(loops)
