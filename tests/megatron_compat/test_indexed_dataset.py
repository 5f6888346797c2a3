"""MMIDIDX v1 files: byte identity with megatron-core's builder, reader parity on files megatron wrote,
and the open-time checks that name the broken file."""
from __future__ import annotations

import os
import pickle
import struct

import numpy
import pytest
import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data.indexed_dataset import (DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path,
                                                  get_idx_path)

mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _documents(seed=0, n_docs=40, vocab=50000):
    """Random documents of 0..3 sequences each (empty sequences and empty documents included)."""
    rng = numpy.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        lengths = [int(x) for x in rng.integers(0, 30, size=rng.integers(0, 4))]
        docs.append([rng.integers(0, vocab, size=n).astype(numpy.int64) for n in lengths])
    return docs


def _build(builder_cls, prefix, docs, dtype, multimodal=False, per_item=False):
    builder = builder_cls(get_bin_path(prefix), dtype=dtype, multimodal=multimodal)
    for d, doc in enumerate(docs):
        if per_item:
            for s, seq in enumerate(doc):
                builder.add_item(torch.from_numpy(seq), mode=(d + s) % 3)
            builder.end_document()
        else:
            flat = numpy.concatenate(doc) if doc else numpy.empty(0, dtype=numpy.int64)
            builder.add_document(torch.from_numpy(flat), [len(s) for s in doc],
                                 modes=[(d + s) % 3 for s in range(len(doc))] if multimodal else None)
    builder.finalize(get_idx_path(prefix))


def _same_files(a, b):
    for get in (get_bin_path, get_idx_path):
        with open(get(a), "rb") as fa, open(get(b), "rb") as fb:
            assert fa.read() == fb.read(), get(a)


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.int64])
@pytest.mark.parametrize("per_item", [False, True])
def test_builder_bytes_match_megatron(tmp_path, dtype, per_item):
    docs = _documents(vocab=60000 if dtype is numpy.uint16 else 10**6)
    _build(mcore.IndexedDatasetBuilder, str(tmp_path / "ref"), docs, dtype, per_item=per_item)
    _build(IndexedDatasetBuilder, str(tmp_path / "ours"), docs, dtype, per_item=per_item)
    _same_files(tmp_path / "ref", tmp_path / "ours")


def test_multimodal_bytes_and_modes_match_megatron(tmp_path):
    docs = _documents(seed=1)
    _build(mcore.IndexedDatasetBuilder, str(tmp_path / "ref"), docs, numpy.int32, multimodal=True, per_item=True)
    _build(IndexedDatasetBuilder, str(tmp_path / "ours"), docs, numpy.int32, multimodal=True, per_item=True)
    _same_files(tmp_path / "ref", tmp_path / "ours")
    ours = IndexedDataset(str(tmp_path / "ref"), multimodal=True)
    ref = mcore.IndexedDataset(str(tmp_path / "ref"), multimodal=True)
    assert numpy.array_equal(ours.sequence_modes, ref.index.sequence_modes)
    tokens, mode = ours[3]
    ref_tokens, ref_mode = ref[3]
    assert numpy.array_equal(tokens, ref_tokens) and mode == ref_mode


def test_add_documents_batch_matches_megatron(tmp_path):
    docs = _documents(seed=2)
    _build(mcore.IndexedDatasetBuilder, str(tmp_path / "ref"), docs, numpy.uint16)
    builder = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "ours")), dtype=numpy.uint16)
    for half in (docs[:17], docs[17:]):
        seqs = [s for doc in half for s in doc]
        flat = numpy.concatenate(seqs).astype(numpy.uint16) if seqs else numpy.empty(0, numpy.uint16)
        builder.add_documents(flat.tobytes(), [len(s) for s in seqs], [len(doc) for doc in half])
    builder.finalize(get_idx_path(str(tmp_path / "ours")))
    _same_files(tmp_path / "ref", tmp_path / "ours")


def test_add_index_merge_matches_megatron(tmp_path):
    parts = [_documents(seed=s, n_docs=15) for s in (3, 4, 5)]
    for i, docs in enumerate(parts):
        _build(mcore.IndexedDatasetBuilder, str(tmp_path / f"part{i}"), docs, numpy.int32)
    for cls, name in ((mcore.IndexedDatasetBuilder, "ref"), (IndexedDatasetBuilder, "ours")):
        builder = cls(get_bin_path(str(tmp_path / name)), dtype=numpy.int32)
        for i in range(3):
            builder.add_index(str(tmp_path / f"part{i}"))
        builder.finalize(get_idx_path(str(tmp_path / name)))
    _same_files(tmp_path / "ref", tmp_path / "ours")


def test_add_index_refuses_other_dtype(tmp_path):
    _build(IndexedDatasetBuilder, str(tmp_path / "a"), _documents(n_docs=3), numpy.uint16)
    builder = IndexedDatasetBuilder(get_bin_path(str(tmp_path / "b")), dtype=numpy.int32)
    with pytest.raises(UsageError, match="a.idx: token dtype uint16 differs"):
        builder.add_index(str(tmp_path / "a"))


@pytest.mark.parametrize("mmap", [True, False])
def test_reader_matches_megatron_on_its_files(tmp_path, mmap):
    prefix = str(tmp_path / "ref")
    _build(mcore.IndexedDatasetBuilder, prefix, _documents(seed=6, n_docs=60), numpy.uint16)
    ref = mcore.IndexedDataset(prefix, mmap=mmap)
    ours = IndexedDataset(prefix, mmap=mmap)
    assert len(ours) == len(ref) and ours.path_prefix == prefix
    assert numpy.array_equal(ours.sequence_lengths, ref.sequence_lengths)
    assert ours.sequence_lengths.dtype == numpy.int32
    assert numpy.array_equal(ours.document_indices, ref.document_indices)
    assert numpy.array_equal(ours.index.sequence_pointers, ref.index.sequence_pointers)
    assert ours.index.dtype == ref.index.dtype == numpy.uint16
    for i in range(len(ref)):
        assert numpy.array_equal(ours[i], ref[i]) and ours[i].dtype == ref[i].dtype
        length = int(ref.sequence_lengths[i])
        for offset, size in ((0, None), (length // 2, None), (length // 3, length // 3)):
            assert numpy.array_equal(ours.get(i, offset=offset, length=size), ref.get(i, offset, size))
    assert numpy.array_equal(ours[numpy.int64(5)], ref[5])
    for start, stop in ((0, len(ref)), (5, 20), (7, 8)):
        for a, b in zip(ours[start:stop], ref[start:stop], strict=True):
            assert numpy.array_equal(a, b)
    assert ours[3:3] == []
    with pytest.raises(ValueError, match="contiguous"):
        ours[0:10:2]


def test_pickle_reopens(tmp_path):
    prefix = str(tmp_path / "d")
    _build(IndexedDatasetBuilder, prefix, _documents(n_docs=5), numpy.int32)
    ds = pickle.loads(pickle.dumps(IndexedDataset(prefix, mmap=False)))
    assert ds.mmap is False and numpy.array_equal(ds[1], IndexedDataset(prefix)[1])


def test_empty_dataset_and_exists(tmp_path):
    prefix = str(tmp_path / "e")
    assert not IndexedDataset.exists(prefix)
    _build(IndexedDatasetBuilder, prefix, [[], []], numpy.uint16)
    assert IndexedDataset.exists(prefix)
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and list(ds.document_indices) == [0, 0, 0]


def test_optimal_dtype_and_codes():
    assert DType.optimal_dtype(65499) is numpy.uint16
    assert DType.optimal_dtype(65500) is numpy.int32 and DType.optimal_dtype(None) is numpy.int32
    for member in DType:
        assert DType.code_from_dtype(DType.dtype_from_code(member.value)) == member.value
        assert DType.size(member.value) == mcore.DType.size(member.value)
        assert member.value == mcore.DType[member.name].value


# ---- open-time checks: each names the broken file ----

@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    _build(IndexedDatasetBuilder, prefix, _documents(seed=7, n_docs=10), numpy.int32)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_missing_files(tmp_path, good):
    os.remove(get_bin_path(good))
    with pytest.raises(UsageError, match=r"good\.bin: file not found"):
        IndexedDataset(good)
    with pytest.raises(UsageError) as info:
        IndexedDataset(str(tmp_path / "nothing"))
    assert len(info.value.messages) == 2


def test_wrong_magic(good):
    _patch(get_idx_path(good), 0, b"XXXXXXX")
    with pytest.raises(UsageError, match=r"good\.idx: not an MMIDIDX index"):
        IndexedDataset(good)


def test_wrong_version(good):
    _patch(get_idx_path(good), 9, struct.pack("<Q", 2))
    with pytest.raises(UsageError, match=r"good\.idx: unsupported index version 2"):
        IndexedDataset(good)


def test_unknown_dtype_code(good):
    _patch(get_idx_path(good), 17, struct.pack("<B", 9))
    with pytest.raises(UsageError, match=r"good\.idx: unknown token dtype code 9"):
        IndexedDataset(good)


def test_truncated_index(good):
    idx = get_idx_path(good)
    os.truncate(idx, os.path.getsize(idx) - 8)
    with pytest.raises(UsageError, match=r"good\.idx: truncated index"):
        IndexedDataset(good)
    os.truncate(idx, 20)
    with pytest.raises(UsageError, match=r"good\.idx: truncated index \(20 bytes"):
        IndexedDataset(good)


def test_short_bin(good):
    binp = get_bin_path(good)
    os.truncate(binp, os.path.getsize(binp) - 4)
    with pytest.raises(UsageError, match=r"good\.bin: data file is \d+ bytes but its index needs"):
        IndexedDataset(good)


def test_builder_refuses_unknown_dtype(tmp_path):
    with pytest.raises(UsageError, match="float16: not an indexed-dataset token dtype"):
        IndexedDatasetBuilder(str(tmp_path / "x.bin"), dtype=numpy.float16)


def _single(tmp_path, name, docs, dtype=numpy.uint16):
    prefix = str(tmp_path / name)
    _build(mcore.IndexedDatasetBuilder, prefix, [[numpy.asarray(d, dtype=numpy.int64)] for d in docs], dtype)
    return prefix


def test_dtype_code_disagreeing_with_the_data_is_refused(tmp_path):
    """uint16 tokens whose header says uint8 (code 1): caught by the byte pointers, and with a single
    sequence (no pointer step to compare) by the .bin being larger than the index describes."""
    many = _single(tmp_path, "many", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    _patch(get_idx_path(many), 17, struct.pack("<B", DType.uint8.value))
    with pytest.raises(UsageError) as info:
        IndexedDataset(many)
    assert str(info.value) == (f"{get_idx_path(many)}: token dtype uint8 (1 bytes a token) disagrees with its "
                               "sequence pointers (2 bytes a token) — the dtype code is wrong or the index is "
                               "corrupt; re-run preprocessing")
    one = _single(tmp_path, "one", [[1, 2, 3, 4]])
    _patch(get_idx_path(one), 17, struct.pack("<B", DType.uint8.value))
    with pytest.raises(UsageError) as info:
        IndexedDataset(one)
    assert str(info.value) == (f"{get_bin_path(one)}: data file is 8 bytes but its index ({get_idx_path(one)}, "
                               "token dtype uint8) describes 4 — the dtype code is wrong or the files do not "
                               "belong together; re-run preprocessing")
    # the other way: uint16 data read as int32 (the .bin is then shorter than the index needs)
    other = _single(tmp_path, "other", [[1, 2, 3, 4]])
    _patch(get_idx_path(other), 17, struct.pack("<B", DType.int32.value))
    with pytest.raises(UsageError, match=r"other\.bin: data file is 8 bytes but its index needs 16"):
        IndexedDataset(other)


def test_token_ids_beyond_the_vocabulary_are_refused_and_the_range_cached(tmp_path):
    from megatron_compat.data.token_range import check_token_ids, token_range

    prefix = _single(tmp_path, "ids", [[1, 2, 3], [4, 999], [0, 7]])
    check_token_ids(prefix, 1000)
    cache = prefix + ".token_range"
    assert os.path.isfile(cache) and token_range(prefix) == (0, 999)
    with pytest.raises(UsageError) as info:
        check_token_ids(prefix, 500)
    assert str(info.value) == (f"{get_bin_path(prefix)}: token id 999 is outside the tokenizer's vocabulary "
                               "(size 500) — the data was tokenized with another tokenizer; preprocess it with "
                               "this run's tokenizer or train with the one it was made with")
    # the cache is used while the .bin is unchanged, recomputed when it changes
    with open(cache, "w") as f:
        f.write(f"{os.path.getsize(get_bin_path(prefix))} {os.stat(get_bin_path(prefix)).st_mtime_ns} 0 5\n")
    assert token_range(prefix) == (0, 5)
    _single(tmp_path, "ids", [[1, 2], [3]])
    os.utime(get_bin_path(prefix), ns=(1, 1))
    assert token_range(prefix) == (1, 3)
