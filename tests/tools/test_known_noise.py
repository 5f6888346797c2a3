"""Importing the project and then transformers' models (as every tool does) prints nothing: torchao's CUDA-only
extension lines and torch's pytree Enum notes, which torchao (the `quant` extra) triggers, are silenced once by the
package (fsdp2_backend/known_noise.py); torch 2.13 with torchao 0.18 prints four such lines without it."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.launchers import REPO

IMPORTS = "import transformers.models.qwen3.modeling_qwen3, torchao"


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="the noise comes with torchao (quant extra)")
def test_tool_imports_print_nothing():
    result = subprocess.run([sys.executable, "-c", f"import fsdp2_backend; {IMPORTS}"], capture_output=True,
                            text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0 and result.stderr == ""


def test_export_all_gather_note_is_silenced_and_reductions_still_show():
    """The export under TP gathered each weight with two sequential all-gathers, and torch logged its
    "suboptimal ... reduction orders" note on every rank; a reduction (all_reduce) note still shows."""
    note = ("import fsdp2_backend, logging\n"
            "log = logging.getLogger('torch.distributed.tensor._redistribute')\n"
            "fmt = ('While redistributing from %s to %s, %d sequential %s operations will be performed. This is '\n"
            "       'suboptimal: ... reduction orders. %s')\n"
            "log.warning(fmt, '(_StridedShard(dim=0, sf=2), Shard(dim=0))', '(Replicate(), Replicate())', 2, "
            "'all_gather', 'it is not possible to merge non-ascending order all_gather operations.')\n"
            "log.warning(fmt, '(Partial(sum), Partial(sum))', '(Replicate(), Replicate())', 2, 'all_reduce', 'x')\n")
    result = subprocess.run([sys.executable, "-c", note], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0 and "all_gather" not in result.stderr and "2 sequential all_reduce" in result.stderr
