"""tools/merge_datasets.py: Megatron's flags and folder rules, output byte-identical to megatron-core's
IndexedDatasetBuilder.add_index merge (what Megatron-LM's merge_datasets.py runs), one-line errors."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy
import pytest
import torch

from tests.support.launchers import REPO

mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")

TOOL = os.path.join(REPO, "tools", "merge_datasets.py")


def _shard(prefix, seed, dtype=numpy.uint16, multimodal=False):
    rng = numpy.random.default_rng(seed)
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for d in range(int(rng.integers(1, 30))):
        for s in range(int(rng.integers(0, 3))):
            builder.add_item(torch.from_numpy(rng.integers(0, 60000, int(rng.integers(0, 20)))), mode=(d + s) % 2)
        builder.end_document()
    builder.finalize(prefix + ".idx")


def _megatron_merge(prefixes, out, dtype, multimodal=False):
    builder = mcore.IndexedDatasetBuilder(out + ".bin", dtype=dtype, multimodal=multimodal)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(out + ".idx")


def _run(*args):
    return subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=120)


def _bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


@pytest.mark.parametrize("multimodal", [False, True])
def test_merge_is_byte_identical_to_megatron(tmp_path, multimodal):
    shards = tmp_path / "shards"
    shards.mkdir()
    names = ["b_text_document", "a_text_document", "c_text_document"]
    for i, name in enumerate(names):
        _shard(str(shards / name), seed=i, multimodal=multimodal)
    (shards / "a_text_document.token_range").write_text("0 0 0 1\n")  # our cache beside an index: passed over
    (shards / "sub").mkdir()  # folders are passed over
    expected = str(tmp_path / "expected")
    _megatron_merge([str(shards / n) for n in sorted(names)], expected, numpy.uint16, multimodal)
    result = _run("--input", shards, "--output-prefix", tmp_path / "merged",
                  *(["--multimodal"] if multimodal else []))
    assert result.returncode == 0, result.stderr
    assert _bytes(str(tmp_path / "merged")) == _bytes(expected)


def test_merge_errors_are_one_line(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    _shard(str(shards / "a"), seed=1)
    _shard(str(shards / "b"), seed=2, dtype=numpy.int32)
    result = _run("--input", shards, "--output-prefix", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == (f"error: {shards / 'b'}.idx: token dtype int32 differs from the builder's uint16 — "
                             "merge datasets made with the same tokenizer\n")
    assert not list(tmp_path.glob("out*"))  # nothing half-written
    os.remove(shards / "b.idx")
    result = _run("--input", shards, "--output-prefix", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr == (f"error: --input: {shards / 'b.bin'} has no .idx file beside it — every file in "
                             "the folder must belong to a .bin/.idx pair\n")
    result = _run("--input", tmp_path / "nowhere", "--output-prefix", tmp_path / "out")
    assert result.stderr == (f"error: --input: {tmp_path / 'nowhere'} is not a directory or does not exist — give "
                             "the folder of the .bin/.idx pairs to merge\n")
    result = _run("--input", shards, "--output-prefix", tmp_path / "missing" / "out")
    assert result.stderr == (f"error: --output-prefix: {tmp_path / 'missing'} is not a directory or does not "
                             "exist — create it first\n")
