"""The same command run again after its run finished (issue 41), through pretrain_fsdp2.py: one line saying the
run is finished, exit code 0, and nothing written into --save — for a blended --data-path (it used to exit 2 with
"consumed samples ... already reach the dataset's ... samples") and for other data (it used to save and export
again). A rerun after an export that did not complete writes only the export (it used to save the final
checkpoint again, needing a second checkpoint's space). The export's shards are mode 0644 (under umask 022) and
no empty "Writing model shards: 0it" bar is printed. A longer --train-iters then meets the
schedule check: one line naming Megatron's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler.
Four short processes of a 2-layer model (~40 s on 2 busy cores)."""
from __future__ import annotations

import os
import re
import shutil

import pytest

from tests.support.megatron_lines import FAULT_RUN_FLAGS
from tests.support.launchers import run_entry
from tests.support.launchers import MEGATRON_LINE
from tests.support.megatron_reference import write_corpus

pytestmark = pytest.mark.e2e


def _files(folder):
    """Every file under `folder` with its size and modification time."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            stat = os.stat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def _finished(result, save, exported=False):
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    did = "only the missing HF export was written" if exported else "nothing was trained, saved or exported"
    line = (f"training already finished: {save}/iter_0000003 is iteration 3 of 3 (--train-iters / "
            f"training.max_steps) — {did}; raise --train-iters to train further")
    assert re.findall(r"^training already finished.*$", result.stdout, re.MULTILINE) == [line], result.stdout[-3000:]
    assert not MEGATRON_LINE.search(result.stdout) and "error" not in result.stderr


def test_a_finished_run_run_again(tmp_path):
    data = tmp_path / "data"
    web = write_corpus(str(data / "web_text_document"), 40, seed=1, vocab_size=128)
    books = write_corpus(str(data / "books_text_document"), 40, seed=2, vocab_size=128)
    save = tmp_path / "ckpt"
    flags = [f for f in FAULT_RUN_FLAGS if f != "--mock-data"]
    blended = flags + ["--data-path", "0.3", web, "0.7", books, "--train-iters", "3", "--save", str(save),
                       "--save-interval", "2", "--data-cache-path", str(tmp_path / "cache")]
    first = run_entry(blended)
    assert first.returncode == 0 and (save / "iter_0000003").is_dir() and (save / "hf").is_dir(), first.stderr[-3000:]
    # the export's shards are readable by the other users of a shared file system (safetensors writes 0600), and
    # transformers' empty "Writing model shards: 0it" bar (its config-only save) is not shown
    umask = os.umask(0)
    os.umask(umask)
    shards = list((save / "hf").glob("*.safetensors"))
    assert shards and {oct(p.stat().st_mode & 0o777) for p in shards} == {oct(0o666 & ~umask)}
    assert "Writing model shards" not in first.stdout + first.stderr
    before = _files(save)
    _finished(run_entry(blended), save)
    assert _files(save) == before
    # the export did not complete (e.g. a full disk): the rerun writes it, and saves no checkpoint — whatever the
    # data (here none)
    shutil.rmtree(save / "hf")
    _finished(run_entry(flags + ["--mock-data", "--train-iters", "3", "--save", str(save)]), save, exported=True)
    after = _files(save)
    assert {k: v for k, v in after.items() if not k.startswith("hf/")} == {
        k: v for k, v in before.items() if not k.startswith("hf/")}
    assert sorted(k for k in after if k.startswith("hf/")) == sorted(k for k in before if k.startswith("hf/"))
    # as the line says, a longer --train-iters trains further — its schedule differs from the checkpoint's: one
    # line naming Megatron's two flags (was one line per schedule value, naming the native field)
    longer = run_entry(blended[:blended.index("--train-iters")] + ["--train-iters", "6"]
                 + blended[blended.index("--train-iters") + 2:])
    errors = [line for line in longer.stderr.splitlines() if line.startswith("error:")]
    assert longer.returncode == 2 and len(errors) == 1 and errors[0].startswith(
        "error: learning-rate schedule differs from the checkpoint's (wd_incr_steps: this run 6 iterations (12 "
        "samples), checkpoint 3 iterations (6 samples)"), longer.stderr[-3000:]
    assert errors[0].endswith("add --override-opt_param-scheduler (this run's schedule wins) or "
                              "--use-checkpoint-opt_param-scheduler (the checkpoint's wins); natively "
                              "training.lr_scheduler_on_resume: override / checkpoint")
