"""tools/*.py run from a checkout whose package is not installed (issue 41: an ImportError traceback there, while
pretrain_fsdp2.py worked): each script's --help under `python -S` (no site-packages, hence no installed package —
as in a fresh clone before `pip install -e .`), and the files convert_checkpoint.py's help names exist."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted((REPO / "tools").glob("*.py"))


@pytest.mark.parametrize("tool", TOOLS, ids=[t.name for t in TOOLS])
def test_help_from_an_uninstalled_checkout(tool, tmp_path):
    result = subprocess.run([sys.executable, "-S", str(tool), "--help"], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout.strip()


def test_convert_checkpoint_help_names_files_that_exist():
    text = subprocess.run([sys.executable, "-S", str(REPO / "tools" / "convert_checkpoint.py"), "--help"],
                          capture_output=True, text=True, timeout=120).stdout
    named = re.findall(r"[\w/]+/[\w]+\.py", " ".join(text.split()))
    assert named and all((REPO / path).is_file() for path in named), named
