"""Importing the project and then transformers' models (as every tool does) prints nothing: torchao's CUDA-only
extension lines and torch's pytree Enum notes, which torchao (the `quant` extra) triggers, are silenced once by the
package (fsdp2_backend/known_noise.py); torch 2.13 with torchao 0.18 prints four such lines without it."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.helpers import REPO

IMPORTS = "import transformers.models.qwen3.modeling_qwen3, torchao"


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the noise comes with torchao (quant extra)")
def test_tool_imports_print_nothing():
    result = subprocess.run([sys.executable, "-c", f"import fsdp2_backend; {IMPORTS}"], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0 and result.stderr == ""
