"""BlendedMegatronDatasetBuilder / BlendedDataset parity with megatron-core 0.16.1: the same datasets per split
and, for every sample, the same dataset id, tokens, labels, loss_mask and position_ids."""
from __future__ import annotations

import pytest

from megatron_compat.data.blended import BlendedDataset
from megatron_compat.data.builder import BlendedMegatronDatasetBuilder
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_compat.data.utils import get_blend_from_list
from tests.support.megatron_reference import IdsTokenizer, assert_same_samples, write_corpus

mcore_gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder as MBuilder)

FLAGS = dict(reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return [write_corpus(str(root / f"c{i}_text_document"), 1000, seed=10 + i, max_len=30) for i in range(3)]


def _build_both(tmp_path, sizes, mock=False, seq=16, **config):
    """megatron-core's datasets and ours. megatron-core caches beside the data (its BlendedDataset needs a
    process group to use path_to_cache); ours caches in its own folder."""
    common = dict(random_seed=4321, sequence_length=seq, tokenizer=IdsTokenizer(), **FLAGS, **config)
    ref = MBuilder(mcore_gpt.MockGPTDataset if mock else mcore_gpt.GPTDataset, sizes, lambda: True,
                   mcore_gpt.GPTDatasetConfig(**common)).build()
    ours = BlendedMegatronDatasetBuilder(MockGPTDataset if mock else GPTDataset, sizes, lambda: True,
                                         GPTDatasetConfig(path_to_cache=str(tmp_path / "ours"), **common)).build()
    return ref, ours


def _assert_splits_match(ref, ours, stride=1):
    assert [type(d).__name__ for d in ref] == [type(d).__name__ for d in ours]
    for expected, got in zip(ref, ours):
        if expected is not None:
            assert_same_samples(expected, got, indices=range(0, len(expected), stride))


def test_three_way_weighted_blend_with_969_30_1_split(corpora, tmp_path):
    blend = get_blend_from_list(["0.5", corpora[0], "0.3", corpora[1], "0.2", corpora[2]])
    ref, ours = _build_both(tmp_path, [2000, 200, 20], blend=blend, split="969,30,1")
    assert all(isinstance(d, BlendedDataset) for d in ours) and [len(d) for d in ours] == [len(d) for d in ref]
    _assert_splits_match(ref, ours)
    # The test split holds one document per corpus, so its samples come from many epochs of it.
    assert all(len(d.indices) == 1 and d.document_index.shape[0] > 5 for d in ours[2].datasets)


def test_unweighted_blend_by_dataset_sizes_and_exhaustive(corpora, tmp_path):
    ref, ours = _build_both(tmp_path, [500, None, 30], blend=(corpora[:2], None), split="90,8,2")
    _assert_splits_match(ref, ours)
    assert ours[1].size is None  # exhaustive: every sample of both one-epoch datasets


def test_per_split_paths(corpora, tmp_path):
    blend_per_split = [get_blend_from_list(["30", corpora[0], "70", corpora[2]]), ([corpora[1]], None), None]
    ref, ours = _build_both(tmp_path, [700, 64, 0], blend_per_split=blend_per_split)
    assert ours[2] is None and isinstance(ours[1], GPTDataset)
    _assert_splits_match(ref, ours)


def test_multiple_validation_sets(corpora, tmp_path):
    blend_per_split = [([corpora[0]], None), (corpora[1:], None), None]
    ref, ours = _build_both(tmp_path, [100, None, 0], blend_per_split=blend_per_split,
                            multiple_validation_sets=True)
    assert isinstance(ours[1], list) and len(ours[1]) == 2
    for expected, got in zip(ref[1], ours[1]):
        assert_same_samples(expected, got)


def test_single_prefix_split(corpora, tmp_path):
    ref, ours = _build_both(tmp_path, [300, 40, 10], blend=([corpora[2]], None), split="969,30,1")
    _assert_splits_match(ref, ours)


def test_mock_data_through_the_builder(tmp_path):
    ref, ours = _build_both(tmp_path, [200, 20, 20], mock=True, seq=1024)
    _assert_splits_match(ref, ours, stride=11)


def test_oversampled_blend_names_the_surplus(corpora, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=16, tokenizer=IdsTokenizer(), **FLAGS,
                              blend=get_blend_from_list(["0.5", corpora[0], "0.5", corpora[1]]), split="100,0,0",
                              path_to_cache=str(tmp_path))
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, [100, 0, 0], lambda: True, config).build()[0].datasets
    with pytest.raises(IndexError, match="mid_level_dataset_surplus"):
        BlendedDataset(datasets, [0.5, 0.5], 10 * len(datasets[0]), config)


def test_mid_level_dataset_surplus_flag_is_mapped():
    """--mid-level-dataset-surplus reaches the dataset config (its effect on the indices is checked against
    megatron-core in test_index_cache_compat.py)."""
    from megatron_compat.translate import translate_megatron

    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data "
            "--tokenizer-type NullTokenizer --vocab-size 100").split()
    translation = translate_megatron(base + ["--mid-level-dataset-surplus", "0.25"])
    assert translation.report.declined == []
    assert translation.fields["data"]["mid_level_dataset_surplus"] == 0.25
