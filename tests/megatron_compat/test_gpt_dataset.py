"""GPTDataset parity with megatron-core 0.16.1: the same document/sample/shuffle indices and, for every sample,
the same tokens, labels, loss_mask, position_ids (and attention_mask when asked for)."""
from __future__ import annotations

import numpy
import pytest

from megatron_compat.data import index_building
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset
from megatron_compat.data.indexed_dataset import IndexedDataset
from megatron_compat.data.utils import Split
from fsdp2_backend.usage_errors import UsageError
from tests.support.megatron_reference import IdsTokenizer, assert_same_samples, write_corpus

mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
from megatron.core.datasets.indexed_dataset import IndexedDataset as MIndexedDataset  # noqa: E402
from megatron.core.datasets.utils import Split as MSplit  # noqa: E402

NUM_DOCS = 120


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus") / "text_document"), NUM_DOCS, seed=0, empty_every=17)


def _pair(corpus, tmp_path, num_samples, split=Split.train, docs=None, seq=32, tokenizer=None, **flags):
    """(megatron-core's GPTDataset, ours) over the same documents, each with its own cache folder."""
    flags = {"reset_position_ids": False, "reset_attention_mask": False, "eod_mask_loss": False,
             "create_attention_mask": False, **flags}
    tokenizer = tokenizer or IdsTokenizer()
    docs = numpy.arange(NUM_DOCS, dtype=numpy.int32) if docs is None else docs
    common = dict(random_seed=1234, sequence_length=seq, blend=([corpus], None), split="100,0,0",
                  tokenizer=tokenizer, **flags)
    ref = mcore.GPTDataset(MIndexedDataset(corpus), corpus, docs, num_samples, MSplit[split.name],
                           mcore.GPTDatasetConfig(path_to_cache=str(tmp_path / "mcore"), **common))
    ours = GPTDataset(IndexedDataset(corpus), corpus, docs, num_samples, split,
                      GPTDatasetConfig(path_to_cache=str(tmp_path / "ours"), **common))
    return ref, ours


def _assert_same_indices(ref, ours):
    for name in ("document_index", "sample_index", "shuffle_index"):
        expected, got = numpy.asarray(getattr(ref, name)), numpy.asarray(getattr(ours, name))
        assert expected.dtype == got.dtype and numpy.array_equal(expected, got), name


def _tokens_per_epoch(corpus):
    dataset = MIndexedDataset(corpus)  # keep it alive: its arrays are views of its memory map
    return int(dataset.sequence_lengths.sum())


@pytest.mark.parametrize("num_samples", [None, 1, 150, 1000])
def test_samples_match_megatron(corpus, tmp_path, num_samples):
    ref, ours = _pair(corpus, tmp_path, num_samples)
    _assert_same_indices(ref, ours)
    assert_same_samples(ref, ours)


def test_many_epochs_and_separate_final_epoch(corpus, tmp_path):
    tokens = _tokens_per_epoch(corpus)
    # 13 epochs either way; a final epoch contributing 3 samples is shuffled on its own, one contributing
    # nearly a whole epoch is not.
    for num_samples, separate in [((12 * tokens - 1) // 16 + 3, True), ((13 * tokens - 1) // 16 - 1, False)]:
        ref, ours = _pair(corpus, tmp_path / str(num_samples), num_samples, seq=16)
        _assert_same_indices(ref, ours)
        last_epoch = numpy.sort(numpy.asarray(ours.document_index[-NUM_DOCS:]))
        assert numpy.array_equal(last_epoch, numpy.arange(NUM_DOCS)) == separate
        assert_same_samples(ref, ours, indices=range(0, len(ref), 7))


@pytest.mark.parametrize("flags", [
    dict(reset_position_ids=True),
    dict(eod_mask_loss=True),
    dict(reset_attention_mask=True, create_attention_mask=True),
    dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True, create_attention_mask=True),
    dict(create_attention_mask=True),
])
def test_reset_and_eod_flags_match_megatron(corpus, tmp_path, flags):
    ref, ours = _pair(corpus, tmp_path, 300, **flags)
    assert_same_samples(ref, ours)


@pytest.mark.parametrize("tokenizer", [IdsTokenizer(pad=7), IdsTokenizer(pad=0), IdsTokenizer(vocab_size=70000)])
def test_pad_token_rules_match_megatron(corpus, tmp_path, tokenizer):
    # pad 7 occurs in the data and is masked; pad == eod collides and falls back to -1, like megatron-core.
    ref, ours = _pair(corpus, tmp_path, 200, tokenizer=tokenizer, eod_mask_loss=True)
    assert_same_samples(ref, ours)


def test_split_subsets_partial_validation_and_no_extra_token(corpus, tmp_path):
    docs = numpy.arange(90, 117, dtype=numpy.int32)
    ref, ours = _pair(corpus, tmp_path / "a", 77, split=Split.valid, docs=docs,
                      drop_last_partial_validation_sequence=False)
    _assert_same_indices(ref, ours)
    assert_same_samples(ref, ours)
    ref, ours = _pair(corpus, tmp_path / "b", 333, docs=docs, add_extra_token_to_sequence=False)
    _assert_same_indices(ref, ours)
    assert_same_samples(ref, ours)


def test_cache_is_written_then_reused(corpus, tmp_path):
    _, first = _pair(corpus, tmp_path, 100)
    files = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert len(files) == 4 and not any(".tmp" in f for f in files)
    again = GPTDataset(IndexedDataset(corpus), corpus, first.indices, 100, Split.train, first.config)
    assert isinstance(again.sample_index, numpy.memmap)  # loaded, not rebuilt
    assert_same_samples(first, again, indices=range(0, 100, 9))


def test_no_attention_mask_by_default(corpus, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=16, blend=([corpus], None), split="100,0,0",
                              tokenizer=IdsTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path))
    dataset = GPTDataset(IndexedDataset(corpus), corpus, numpy.arange(NUM_DOCS, dtype=numpy.int32), 10,
                         Split.train, config)
    assert sorted(dataset[3]) == ["labels", "loss_mask", "position_ids", "tokens"]


def test_empty_split_raises_instead_of_looping(corpus, tmp_path):
    config = GPTDatasetConfig(random_seed=1, sequence_length=16, blend=([corpus], None), split="100,0,0",
                              tokenizer=IdsTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(tmp_path))
    with pytest.raises(UsageError, match="test split has 0 documents"):
        GPTDataset(IndexedDataset(corpus), corpus, numpy.arange(0, dtype=numpy.int32), 10, Split.test, config)


def test_mock_dataset_matches_megatron():
    tokenizer = IdsTokenizer(vocab_size=500)
    flags = dict(reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=True, create_attention_mask=False)
    ref_config = mcore.GPTDatasetConfig(random_seed=5, sequence_length=64, tokenizer=tokenizer, **flags)
    config = GPTDatasetConfig(random_seed=5, sequence_length=64, tokenizer=tokenizer, **flags)
    docs = numpy.arange(2000, 2600, dtype=numpy.int32)
    ref = mcore.MockGPTDataset(mcore.MockGPTLowLevelDataset(tokenizer), None, docs, 9000, MSplit.valid, ref_config)
    ours = MockGPTDataset(MockGPTLowLevelDataset(tokenizer), None, docs, 9000, Split.valid, config)
    _assert_same_indices(ref, ours)
    assert_same_samples(ref, ours, indices=range(0, len(ref), 97))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("numba_from", [0, None], ids=["numba", "numpy"])
def test_sample_index_matches_cpp_helper_on_awkward_lengths(seed, numba_from, monkeypatch):
    """Zero-length documents (leading ones too), documents shorter than a sample, exact boundaries, kept partial
    samples; 9000 positions, so the walk crosses the kernel's 4096-position length buffer. Both builders: the
    numba kernel (large data sets) and the numpy count (below index_building.NUMBA_FROM entries)."""
    from megatron.core.datasets import helpers

    if numba_from is not None:
        monkeypatch.setattr(index_building, "NUMBA_FROM", numba_from)

    rng = numpy.random.default_rng(seed)
    sizes = rng.integers(0, 9, 3000).astype(numpy.int32)
    sizes[rng.integers(0, 3000, 150)] = 64
    document_index = rng.permutation(numpy.tile(numpy.arange(3000, dtype=numpy.int32), 3))
    # megatron-core asserts (its end row would be -1) when a kept partial sample ends on an empty document
    sizes[document_index[-1]] = max(1, sizes[document_index[-1]])
    sizes[document_index[:seed]] = 0
    tokens = int(sizes.sum())
    for seq_length in (1, 2, 8, 13):
        for drop_last in (True, False):
            for extra in (True, False):
                expected = helpers.build_sample_idx(sizes, document_index, seq_length, 3, tokens, drop_last, extra)
                got = index_building.build_sample_index(sizes, document_index, seq_length, 3, tokens, drop_last,
                                                        extra)
                assert got.dtype == expected.dtype and numpy.array_equal(got, expected), (seq_length, drop_last)


@pytest.mark.parametrize("num", [1, 2, 3, 7, 20, 97])
def test_blending_indices_match_cpp_helper(num):
    """Weighted and exhaustive blends of 1 to 97 datasets, incl. equal weights (ties) and tiny weights."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.utils import normalize

    rng = numpy.random.default_rng(num)
    for raw in (rng.random(num) + 0.01, numpy.ones(num), rng.random(num) ** 6 + 1e-6):
        weights = normalize(list(raw))
        size = 20000
        expected = (numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64))
        helpers.build_blending_indices(*expected, weights, num, size, False)
        got = index_building.build_blending_indices(weights, size)
        assert all(e.dtype == g.dtype and numpy.array_equal(e, g) for e, g in zip(expected, got))
    for sizes in (rng.integers(1, 300, num), numpy.full(num, 50), rng.integers(1, 5, num)):
        sizes = sizes.astype(numpy.int64)
        expected = (numpy.zeros(int(sizes.sum()), numpy.int16), numpy.zeros(int(sizes.sum()), numpy.int64))
        helpers.build_exhaustive_blending_indices(*expected, sizes, num)
        got = index_building.build_exhaustive_blending_indices(list(sizes))
        assert all(e.dtype == g.dtype and numpy.array_equal(e, g) for e, g in zip(expected, got))


@pytest.mark.parametrize("separate", [False, True])
def test_document_and_shuffle_index_match_megatron(separate):
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    documents = numpy.arange(37, 1037, dtype=numpy.int32)
    expected = _build_document_index(documents, 5, numpy.random.RandomState(7), separate)
    got = index_building.build_document_index(documents, 5, numpy.random.RandomState(7), separate)
    assert got.dtype == expected.dtype == numpy.int32 and numpy.array_equal(got, expected)
    for first in (0, 700, 1000):
        expected = _build_shuffle_index(first, 1000, numpy.random.RandomState(first))
        got = index_building.build_shuffle_index(first, 1000, numpy.random.RandomState(first))
        assert got.dtype == expected.dtype == numpy.uint32 and numpy.array_equal(got, expected)


def test_unshuffled_samples_read_the_documents_in_order(corpus, tmp_path, monkeypatch):
    """shuffle=False (ours): sample i is tokens [i*S, i*S + S + 1) of the split's documents concatenated in
    order, epoch after epoch (checked against megatron-core's reader), with no random draws at all; its
    cache never collides with the shuffled one."""
    docs = numpy.arange(10, 100, dtype=numpy.int32)
    seq = 16
    reader = MIndexedDataset(corpus)
    one_epoch = numpy.concatenate([reader[int(d)] for d in docs]).astype(numpy.int64)
    num_samples = 3 * len(one_epoch) // seq  # about three epochs, with a short final one
    common = dict(random_seed=1234, sequence_length=seq, blend=([corpus], None), split="100,0,0",
                  tokenizer=IdsTokenizer(), reset_position_ids=False, reset_attention_mask=False,
                  eod_mask_loss=False, path_to_cache=str(tmp_path))
    config = GPTDatasetConfig(shuffle=False, **common)

    def no_draws(*args, **kwargs):
        raise AssertionError("an unshuffled dataset must not create a RandomState")

    with monkeypatch.context() as patch:
        patch.setattr(numpy.random, "RandomState", no_draws)
        ours = GPTDataset(IndexedDataset(corpus), corpus, docs, num_samples, Split.train, config)
    assert len(ours) >= num_samples
    assert numpy.array_equal(numpy.asarray(ours.shuffle_index), numpy.arange(len(ours)))
    assert numpy.array_equal(numpy.asarray(ours.document_index), numpy.tile(docs, 3))
    stream = numpy.tile(one_epoch, 3)
    for i in list(range(0, len(ours), 11)) + [len(ours) - 1]:
        text = stream[i * seq:i * seq + seq + 1]
        sample = ours[i]
        assert numpy.array_equal(sample["tokens"].numpy(), text[:-1]), i
        assert numpy.array_equal(sample["labels"].numpy(), text[1:]), i
    shuffled = GPTDataset(IndexedDataset(corpus), corpus, docs, num_samples, Split.train, GPTDatasetConfig(**common))
    assert shuffled.unique_description_hash != ours.unique_description_hash
    assert len(list(tmp_path.glob("*.npy"))) == 6  # two separate caches of three arrays
    assert not numpy.array_equal(numpy.asarray(shuffled.shuffle_index), numpy.arange(len(shuffled)))


@pytest.mark.parametrize("dtype", [numpy.int32, numpy.uint32, numpy.int64])
def test_compiled_shuffle_is_numpys(dtype, monkeypatch):
    """Same permutation and same generator state afterwards as RandomState.shuffle, at sizes around the
    32-bit mask boundaries, on views too (the numba kernel forced at every size)."""
    monkeypatch.setattr(index_building, "NUMBA_FROM", 0)
    for n in (0, 1, 2, 3, 17, 1000, 65537, 300000):
        expected, got = numpy.arange(n, dtype=dtype), numpy.arange(n, dtype=dtype)
        theirs, ours = numpy.random.RandomState(n), numpy.random.RandomState(n)
        theirs.shuffle(expected[: n // 2])
        theirs.shuffle(expected[n // 2:])
        index_building.shuffle(got[: n // 2], ours)
        index_building.shuffle(got[n // 2:], ours)
        assert numpy.array_equal(expected, got), n
        assert theirs.randint(1 << 30, size=5).tolist() == ours.randint(1 << 30, size=5).tolist()
