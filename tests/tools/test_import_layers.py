"""The layers the code keeps, read from its own imports (module-level and inside functions alike).

A module may import its own layer and the layers below it, never one above, with no exceptions (the table below,
high to low; the README's "Where things live" shows the same). The stricter rules: model code never sees a mesh or
probes the device (from `distributed` only the DTensor unwrap and rank-0 printing) and uses no torch.distributed at
all (the plan hands it functions), the op library imports nothing of the engine, and validation imports no torch and
no runtime package. Files import each other in no loop, at module level or through imports inside functions. A
module sits in its package's layer: only torch-free facts may be placed apart (in base), so no module is
reclassified to pass. A test that fails names the file, the line and the rule.

The checker is functions over a source dict (module → text: tests/support/import_graph.py), and
`test_each_rule_fires` feeds each rule a small made-up tree that breaks it.
"""
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple


from tests.support.import_graph import (Rules, Source, import_edges, import_loops, read_sources,
                                        torch_distributed_uses)

REPO = Path(__file__).resolve().parents[2]

# High to low: (layer, module prefixes). The longest matching prefix decides a module's layer.
LAYERS: List[Tuple[str, Tuple[str, ...]]] = [
    ("entry", ("pretrain_fsdp2", "tools", "fsdp2_backend.launch", "fsdp2_backend.cli")),
    # the two ways in: Megatron's flags, and the native config's loading and validation (every config module
    # but the values and facts listed under base)
    ("front", ("megatron_compat.parse", "megatron_compat.translate", "fsdp2_backend.config")),
    ("assembly", ("fsdp2_backend.build", "fsdp2_backend.inference")),
    ("engine", ("fsdp2_backend.training", "fsdp2_backend.parallel", "fsdp2_backend.data")),
    # the files a run reads and writes: Megatron's data and checkpoints, and our checkpoint layer
    ("formats", ("megatron_compat.data", "megatron_compat.checkpoint", "fsdp2_backend.checkpoint")),
    # Megatron's model flags → HF config keys (torch-free), from a command line or a checkpoint's saved args
    ("architecture", ("megatron_compat.architecture",)),
    ("models", ("fsdp2_backend.models",)),
    ("distributed", ("fsdp2_backend.distributed",)),
    ("kernels", ("fsdp2_backend.kernels",)),
    # what every layer reads: the config's values and torch-free facts, the error type, the package itself
    ("base", ("fsdp2_backend.usage_errors", "fsdp2_backend.known_noise",
              "megatron_compat.argument_tables",  # where Megatron's argument tables are: the parser's and saved args'

              *(f"fsdp2_backend.config.{name}" for name in (
                  "schema", "schema_training", "fields", "layout",  # the Config and its derived parallel sizes
                  "batch_schedule", "signal_names", "tp_cp_checks", "quant_names",  # facts validation and runtime share
                  "weight_files", "mup_rules")),  # an HF directory's files; µP's multipliers (models read them)
              # the model ids' torch-free specs and their registry (models/<id>/spec.py, read by every layer)
              "fsdp2_backend.models.registry", "fsdp2_backend.models.spec",
              *(f"fsdp2_backend.models.{p.parent.name}.spec"
                for p in (REPO / "fsdp2_backend" / "models").glob("*/spec.py")))),
]
# A package's own __init__ (imported before any of its modules) sits where its values do, not where its prefix does.
PACKAGES = {"fsdp2_backend": "base", "fsdp2_backend.config": "base", "megatron_compat": "front"}

# What model code may take from `distributed`: tensor-level helpers that know no mesh and no device.
MODELS_MAY_USE = ("fsdp2_backend.distributed.dtensor", "fsdp2_backend.distributed.console")
# The op library stands alone: itself and the error type.
KERNELS_MAY_USE = ("fsdp2_backend.kernels", "fsdp2_backend.usage_errors", "fsdp2_backend")
OURS = ("fsdp2_backend", "megatron_compat")


RULES = Rules(LAYERS, PACKAGES, MODELS_MAY_USE, KERNELS_MAY_USE)
SOURCES = read_sources(REPO, OURS)
EDGES = import_edges(SOURCES, OURS)
layer_of = RULES.layer_of


# -- the rules on this repository --------------------------------------------------------------------------
def test_every_module_has_a_layer():
    for module in SOURCES:
        layer_of(module)


def test_no_import_from_a_higher_layer():
    """No exceptions: an import that looks up is moved, not listed."""
    wrong = RULES.upward_imports(SOURCES, EDGES)
    assert not wrong, "\n".join(wrong)


def test_models_know_no_mesh_and_probe_no_device():
    wrong = RULES.models_seeing_a_mesh(SOURCES, EDGES)
    assert not wrong, "\n".join(wrong)


def test_models_use_no_torch_distributed():
    """The plan hands model code functions (e.g. a router's sums over ranks), never a process group."""
    wrong = [use for module, source in SOURCES.items() if layer_of(module) == "models"
             for use in torch_distributed_uses(source)]
    assert not wrong, "model code uses torch.distributed (take functions from the plan instead):\n" + "\n".join(wrong)


def test_the_op_library_stands_alone():
    wrong = RULES.kernels_importing_the_engine(SOURCES, EDGES)
    assert not wrong, "\n".join(wrong)


def test_no_import_loops_between_files():
    loops = import_loops(EDGES, ("module",))
    assert not loops, "module-level import loops:\n" + "\n".join(" <-> ".join(loop) for loop in loops)


def test_no_import_loops_through_function_level_imports():
    """An import inside a function that closes a circle is a loop too: it only runs later."""
    loops = import_loops(EDGES, ("module", "function"))
    assert not loops, ("import loops (counting imports inside functions):\n"
                       + "\n".join(" <-> ".join(loop) for loop in loops))


def test_no_module_is_reclassified():
    wrong = RULES.reclassified(SOURCES)
    assert not wrong, "\n".join(wrong)


def test_validation_imports_no_torch_and_no_runtime():
    # of models only the ids' specs, their registry and the (empty) packages holding them: no model implementation
    code = ("import sys, fsdp2_backend.config.validation, fsdp2_backend.config.loading; "
            "spec = lambda m: m in ('fsdp2_backend.models', 'fsdp2_backend.models.registry', "
            "'fsdp2_backend.models.spec') or m.endswith('.spec') or m + '.spec' in sys.modules; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in ("
            "['fsdp2_backend', 'training'], ['fsdp2_backend', 'parallel'], ['fsdp2_backend', 'models'], "
            "['fsdp2_backend', 'data'], ['fsdp2_backend', 'build']) and not spec(m)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout


# -- each rule fires on a made-up tree that breaks it --------------------------------------------------------
def _tree(**modules: str) -> Dict[str, Source]:
    """Sources from keyword names ("fsdp2_backend__models__x" → fsdp2_backend.models.x)."""
    out = {}
    for key, text in modules.items():
        name = key.replace("__", ".")
        out[name] = Source(name.replace(".", "/") + ".py", text)
    return out


def test_each_rule_fires():
    tree = _tree(
        fsdp2_backend__models__bad=("import torch\nimport torch.distributed as dist\n"
                                    "from torch.distributed.tensor import DTensor\nfrom torch import distributed\n"
                                    "def f(t):\n    dist.all_reduce(t)\n    return torch.distributed.get_rank()\n"
                                    "from fsdp2_backend.training import a\n"
                                    "from fsdp2_backend.distributed import context\n"),
        fsdp2_backend__training__a="from fsdp2_backend.training import b\n",
        fsdp2_backend__training__b="def g():\n    from fsdp2_backend.training import a\n",
        fsdp2_backend__training__c=("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from fsdp2_backend.training import a\n"),
        fsdp2_backend__distributed__context="",
        fsdp2_backend__kernels__k="from fsdp2_backend.models import bad\n",
        fsdp2_backend__models__good="from fsdp2_backend.distributed import dtensor\nimport torch\nx = torch.ones(1)\n",
        fsdp2_backend__distributed__dtensor="",
    )
    edges = import_edges(tree, OURS)
    kinds = {(e.module, e.target): e.kind for e in edges}
    assert kinds[("fsdp2_backend.training.b", "fsdp2_backend.training.a")] == "function"
    assert kinds[("fsdp2_backend.training.c", "fsdp2_backend.training.a")] == "typing"
    # (a) every spelling of torch.distributed in model code, and nothing in clean model code
    uses = torch_distributed_uses(tree["fsdp2_backend.models.bad"])
    assert [u.split(": ", 1)[1] for u in uses] == [
        "import torch.distributed", "from torch.distributed.tensor import ...", "from torch import distributed",
        "dist.all_reduce", "torch.distributed"], uses
    assert torch_distributed_uses(tree["fsdp2_backend.models.good"]) == []
    # (b) a loop closed by an import inside a function, which the module-level rule alone misses; a type-checker's
    # import closes none
    assert import_loops(edges, ("module",)) == []
    assert import_loops(edges, ("module", "function")) == [["fsdp2_backend.training.a", "fsdp2_backend.training.b"]]
    # upward imports, a mesh in model code, the op library importing the engine
    wrong = Rules(LAYERS, PACKAGES).upward_imports(tree, edges)
    assert any("fsdp2_backend.models.bad (models) imports fsdp2_backend.training.a (engine" in w for w in wrong), wrong
    assert any("fsdp2_backend.distributed.context" in w for w in RULES.models_seeing_a_mesh(tree, edges))
    assert RULES.models_seeing_a_mesh(tree, [e for e in edges if e.module == "fsdp2_backend.models.good"]) == []
    assert any("fsdp2_backend.kernels.k imports" in w for w in RULES.kernels_importing_the_engine(tree, edges))
    # (c) a module moved out of its package's layer to pass, or into base while importing torch
    moved = [(name, prefixes + (("fsdp2_backend.models.bad",) if name == "engine" else ())
              + (("fsdp2_backend.models.good",) if name == "base" else ())) for name, prefixes in LAYERS]
    tree_with_layers = {**tree, "fsdp2_backend.models": Source("fsdp2_backend/models/__init__.py", "", True)}
    problems = Rules(moved, PACKAGES).reclassified(tree_with_layers)
    assert any(p.startswith("fsdp2_backend.models.bad: placed in engine") for p in problems), problems
    assert any(p.startswith("fsdp2_backend/models/good.py: placed in base") for p in problems), problems
    assert Rules(moved, PACKAGES).layer_of("fsdp2_backend.models.bad") == "engine"  # the move the rule refuses
