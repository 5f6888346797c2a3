"""Index caches shared with megatron-core 0.16.1: the same tokenizer identifiers (megatron-core's own
`build_tokenizer`), the same cache file names and descriptions, and each side loading the other's caches as
they are — no index is rebuilt (build calls counted, file mtimes unchanged)."""
from __future__ import annotations

import argparse
import os

import numpy
import pytest
import torch.distributed as dist

from megatron_compat.data import index_building
from megatron_compat.data.builder import BlendedMegatronDatasetBuilder
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_compat.data.tokenizer import build_tokenizer
from megatron_compat.data.utils import get_blend_from_list
from tests.support.megatron_reference import assert_same_samples, write_corpus
from fsdp2_backend.cli.demo_assets import train_bytelevel_tokenizer

mcore_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets import helpers as mhelpers  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder as MBuilder)
from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as mcore_build_tokenizer  # noqa

FLAGS = dict(reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False)


def _megatron_args(**values) -> argparse.Namespace:
    """Megatron-LM's tokenizer arguments at their defaults, overridden by `values`."""
    defaults = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None,
                    tokenizer_special_tokens=None, tokenizer_hf_use_fast=True, trust_remote_code=False,
                    tokenizer_hf_include_special_tokens=True, tokenizer_sentencepiece_legacy=False,
                    tokenizer_metadata=None)
    return argparse.Namespace(**{**defaults, **values})


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_bytelevel_tokenizer(path, vocab_size=300)
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return [write_corpus(str(root / f"c{i}_text_document"), 400, seed=20 + i, max_len=30, vocab_size=250)
            for i in range(5)]


@pytest.fixture
def process_group(tmp_path):
    """megatron-core's BlendedDataset asks torch.distributed for the rank when it writes a cache: one rank."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "NullTokenizer"])
def test_tokenizer_identifiers_match_megatron_core(kind, tokenizer_dir):
    if kind == "HuggingFaceTokenizer":
        theirs = mcore_build_tokenizer(_megatron_args(tokenizer_type=kind, tokenizer_model=tokenizer_dir))
        ours = build_tokenizer(kind, tokenizer_model=tokenizer_dir)
    else:
        theirs = mcore_build_tokenizer(_megatron_args(tokenizer_type=kind, vocab_size=500))
        ours = build_tokenizer(kind, vocab_size=500)
    assert list(ours.unique_identifiers.items()) == list(theirs.unique_identifiers.items())


def _configs(corpora, cache, tokenizers, surplus=0.005):
    blend = get_blend_from_list(["3", corpora[0], "1", corpora[1], "2", corpora[2], "0.5", corpora[3],
                                 "1.5", corpora[4]])
    common = dict(random_seed=99, sequence_length=24, blend=blend, split="90,8,2", path_to_cache=str(cache),
                  mid_level_dataset_surplus=surplus, **FLAGS)
    return (mcore_gpt.GPTDatasetConfig(tokenizer=tokenizers[0], **common),
            GPTDatasetConfig(tokenizer=tokenizers[1], **common))


def _snapshot(folder):
    return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}


class _Counter:
    def __init__(self, monkeypatch, module, names):
        self.calls = 0
        for name in names:
            original = getattr(module, name)

            def counted(*args, _original=original, **kwargs):
                self.calls += 1
                return _original(*args, **kwargs)
            monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("first", ["megatron-core", "ours"])
def test_each_side_reads_the_others_caches(first, corpora, tokenizer_dir, tmp_path, process_group, monkeypatch):
    tokenizers = (mcore_build_tokenizer(_megatron_args(tokenizer_type="HuggingFaceTokenizer",
                                                       tokenizer_model=tokenizer_dir)),
                  build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_dir))
    mconfig, config = _configs(corpora, tmp_path / "cache", tokenizers, surplus=0.05)
    sizes = [900, 90, 30]

    def build_theirs():
        return MBuilder(mcore_gpt.GPTDataset, sizes, lambda: True, mconfig).build()

    def build_ours():
        return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()

    writer, reader = (build_theirs, build_ours) if first == "megatron-core" else (build_ours, build_theirs)
    written = writer()
    before = _snapshot(tmp_path / "cache")
    # 5 datasets x 3 splits x 4 files, and 3 blends x 3 files
    assert len(before) == 5 * 3 * 4 + 3 * 3, sorted(before)
    ours_counter = _Counter(monkeypatch, index_building, ["build_sample_index", "build_blending_indices",
                                                          "build_exhaustive_blending_indices"])
    theirs_counter = _Counter(monkeypatch, mhelpers, ["build_sample_idx", "build_blending_indices",
                                                      "build_exhaustive_blending_indices"])
    read = reader()
    assert ours_counter.calls == 0 and theirs_counter.calls == 0  # loaded, not rebuilt
    assert _snapshot(tmp_path / "cache") == before  # no file added or rewritten
    ref, ours = (written, read) if first == "megatron-core" else (read, written)
    for expected, got in zip(ref, ours):
        assert expected.unique_description == got.unique_description
        assert numpy.array_equal(expected.dataset_index, got.dataset_index)
        assert_same_samples(expected, got, indices=range(0, len(expected), 7))


def test_indices_equal_megatron_cores_with_a_surplus(corpora, tokenizer_dir, tmp_path, process_group):
    """Separate caches: every mid-level and blended index built by both sides is equal, dtype included."""
    tokenizers = (mcore_build_tokenizer(_megatron_args(tokenizer_type="HuggingFaceTokenizer",
                                                       tokenizer_model=tokenizer_dir)),
                  build_tokenizer("HuggingFaceTokenizer", tokenizer_model=tokenizer_dir))
    mconfig, _ = _configs(corpora, tmp_path / "theirs", tokenizers, surplus=0.5)
    _, config = _configs(corpora, tmp_path / "ours", tokenizers, surplus=0.5)
    ref = MBuilder(mcore_gpt.GPTDataset, [3000, 300, 30], lambda: True, mconfig).build()
    ours = BlendedMegatronDatasetBuilder(GPTDataset, [3000, 300, 30], lambda: True, config).build()
    for expected, got in zip(ref, ours):
        for name in ("dataset_index", "dataset_sample_index"):
            e, g = getattr(expected, name), getattr(got, name)
            assert e.dtype == g.dtype and numpy.array_equal(e, g), name
        for e_set, g_set in zip(expected.datasets, got.datasets):
            assert len(e_set) == len(g_set)
            for name in ("document_index", "sample_index", "shuffle_index"):
                e, g = getattr(e_set, name), getattr(g_set, name)
                assert e.dtype == g.dtype and numpy.array_equal(e, g), name
    assert sorted(os.listdir(tmp_path / "theirs")) == sorted(os.listdir(tmp_path / "ours"))
