"""Our top-level package is named `kernels`, like the PyPI package transformers probes for (hub kernels).

With this project importable, transformers must not believe the PyPI `kernels` is installed, and an HF model
must still build and train (forward + backward). Runs in a fresh interpreter from the repository root so
that our `kernels` is on the path and transformers' cached probe starts cold.
"""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.util, torch
assert importlib.util.find_spec("kernels").origin.startswith(REPO), importlib.util.find_spec("kernels").origin
from transformers.utils import import_utils
assert import_utils.is_kernels_available() is False, "transformers thinks PyPI kernels is installed"
from transformers import Qwen3ForCausalLM
from tests.helpers import tiny_qwen3_config
torch.manual_seed(0)
model = Qwen3ForCausalLM(tiny_qwen3_config())
ids = torch.randint(0, 512, (2, 16))
out = model(input_ids=ids, labels=ids)
out.loss.backward()
assert torch.isfinite(out.loss)
assert all(p.grad is not None for p in model.parameters())
print("ok")
"""


def test_transformers_does_not_see_pypi_kernels_and_models_still_train():
    code = f"REPO = {str(REPO)!r}\n" + PROBE
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
