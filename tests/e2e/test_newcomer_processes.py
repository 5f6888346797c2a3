"""A newcomer's first hour, the process faults, with real processes (issue 33):

- Ctrl-C under torchrun (SIGINT to torchrun, which hands it to every worker), at TP 2 from a loaded HF model: one
  line from rank 0 naming the iteration and the last checkpoint, no KeyboardInterrupt traceback from any rank;
  the same start shows the mapped flags as one count, one weight-loading bar, and none of the known-harmless
  noise (torchao's .so lines, torch's pytree Enum notes, FSDP2's view-tensor warnings under TP);
- Ctrl-C of a single process: the line and exit code 130;
- a full disk during the HF export (tools/convert_checkpoint.py of that run's checkpoint into a small tmpfs: a real
  ENOSPC; where mounting is not allowed, a file-size limit on the process: a real EFBIG): one `error:` line naming
  the directory, exit code 1, no OUT.tmp left behind.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launchers import ENTRY_ENV, start_entry, wait_for_log
from tests.support.disk import small_disk
from tests.support.launchers import REPO
from tests.support.tiny_models import tiny_model_dir

pytestmark = pytest.mark.e2e

INTERRUPTED = re.compile(r"^interrupted at iteration (\d+); the last checkpoint is (iter_\d+); the same command "
                         r"resumes$", re.MULTILINE)
NOISE = ("Failed to load", "is an Enum subclass", "returned a view tensor", "KeyboardInterrupt", "[rank0]:",
         "[rank1]:")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("qwen3"), seed=0)


def _flags(model_dir, save_dir=None):
    flags = ["--load", model_dir, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", model_dir,
             "--mock-data", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
             "--train-iters", "100000", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0"]
    return flags + (["--save", str(save_dir), "--save-interval", "3"] if save_dir else [])


def test_ctrl_c_and_a_full_disk_during_the_export(model_dir, tmp_path):
    save = tmp_path / "ckpt"
    log = tmp_path / "tp2.log"
    run = start_entry(_flags(model_dir, save) + ["--tensor-model-parallel-size", "2"], log, ranks=2)
    try:
        wait_for_log(run, log, r"successfully saved checkpoint from iteration\s+3 ")
        wait_for_log(run, log, r" iteration\s+4/")
        run.send_signal(signal.SIGINT)  # torchrun alone, as a terminal's Ctrl-C reaches it
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    text = log.read_text()
    lines = INTERRUPTED.findall(text)
    assert len(lines) == 1, text[-3000:]
    iteration, checkpoint = lines[0]
    newest = max(p.name for p in save.iterdir() if p.name.startswith("iter_"))
    assert checkpoint == newest and int(iteration) > int(newest[len("iter_"):]), text[-3000:]
    assert not [n for n in NOISE if n in text], text[-3000:]
    assert text.count("Megatron flags: ") == 1 and re.search(
        r"^Megatron flags: \d+ mapped to native fields \(--dry-run lists each with its field\)$", text, re.MULTILINE)
    assert not re.search(r"^mapped: ", text, re.MULTILINE)
    assert text.count("Loading weights: 100%") == 1, text[-3000:]

    # a single process: the same line (no checkpoint here) and the shell's code for SIGINT
    log = tmp_path / "one.log"
    run = start_entry(_flags(model_dir), log)
    try:
        wait_for_log(run, log, r" iteration\s+2/")
        os.killpg(run.pid, signal.SIGINT)  # the whole foreground group, as a terminal does
        assert run.wait(timeout=120) == 130, log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
    text = log.read_text()
    assert re.search(r"^interrupted at iteration \d+; nothing is saved \(no --save / training\.output_dir\)$", text,
                     re.MULTILINE), text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text

    # the HF export onto a full disk
    with small_disk(tmp_path / "small", 128) as disk:
        out = Path(disk or tmp_path / "small") / "hf"

        def limit_file_size():  # no tmpfs: a file-size limit gives the same failure (EFBIG) for real
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (128 * 1024, 128 * 1024))

        result = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"), str(save),
                                 str(out)], capture_output=True, text=True, env=ENTRY_ENV, cwd=REPO, timeout=300,
                                preexec_fn=None if disk else limit_file_size)
        why = "No space left on device" if disk else "File too large"
        assert result.returncode == 1, result.stderr[-3000:]
        assert result.stderr.splitlines()[-1] == (
            f"error: {out}: writing the Hugging Face export failed ({why}); nothing is left behind — free space or "
            f"fix permissions there, then export again (tools/convert_checkpoint.py CHECKPOINT {out} converts a "
            f"saved checkpoint)"), result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert not out.exists() and not out.with_name("hf.tmp").exists()
