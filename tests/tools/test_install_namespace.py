"""One import namespace: nothing of ours is importable under a name another PyPI project owns.

transformers >= 5.25 depends on Hugging Face's PyPI package `kernels` and imports it on every model load; a
top-level `kernels` of ours once shadowed it (ImportError `CUDAProperties` on every model load). The probe runs in
fresh interpreters, from the repository root (where our packages are on the path) and from elsewhere: the
project's entry point imports, Hugging Face's `kernels` is the one Python finds, transformers sees it, and every
model id of the registry builds and runs a forward and backward pass.
"""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OURS = {"fsdp2_backend", "megatron_compat"}

PROBE = r"""
import sys, importlib.util
import fsdp2_backend.launch  # the entry point's module, and through it the config, build and models
from fsdp2_backend.models.registry import model_spec, registered_model_ids
spec = importlib.util.find_spec("kernels")
assert spec is not None, "Hugging Face's kernels is not installed (transformers >= 5.25 requires it)"
assert not spec.origin.startswith(REPO), spec.origin
import kernels
from transformers.utils import import_utils
assert import_utils.is_kernels_available(), "transformers does not see Hugging Face's kernels"
import torch
from tests.support.tiny_models import TINY_CONFIGS
missing = [i for i in registered_model_ids() if i not in TINY_CONFIGS]
assert not missing, f"no tiny config in tests/support/tiny_models.py for {missing}"
for model_id in registered_model_ids():
    torch.manual_seed(0)
    config = TINY_CONFIGS[model_id]()
    model = model_spec(model_id).build(config)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss), model_id
print("built", len(registered_model_ids()), "model ids; kernels from", kernels.__file__)
"""


def test_top_level_packages_are_ours():
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")}
    assert packages - {"tests"} == OURS, "a top-level package whose name another PyPI project may own"
    assert not (REPO / "tools" / "__init__.py").exists(), "tools/ holds scripts; `tools` is a PyPI project's name"


@pytest.mark.parametrize("where", ["repository root", "elsewhere"])
def test_huggingface_kernels_stays_importable_and_every_model_id_builds(where, tmp_path):
    cwd = REPO if where == "repository root" else tmp_path
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", f"REPO = {str(REPO)!r}\n" + PROBE], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built" in result.stdout


def test_entry_point_runs_from_elsewhere(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "pretrain_fsdp2.py"), "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()
