"""The index arrays behind GPTDataset and BlendedDataset, identical to megatron-core 0.16.1's (its numpy
document and shuffle indices, its C++ `helpers.cpp` sample and blending indices), in megatron-core's dtypes.

Why our own: megatron-core compiles a C++ extension for the loops; a drop-in must not need a compiler or
megatron-core at run time. The document and shuffle indices are built in one array each and shuffled in
place by part (megatron-core builds the parts and concatenates them, and its document index goes through an
int64 grid first), by numpy's own shuffle algorithm on the same `RandomState` (`shuffle`: for arrays large
enough to repay numba's load, `_numba_pays`, a numba kernel drawing from that RandomState's MT19937, 2x faster
than numpy's for 4-byte ids). The sequential loops (sample index, blending) are the numba kernels of
`index_kernels` filling preallocated arrays; a smaller sample index is counted in numpy instead, so that a
small or mid-sized data set's first use in a process costs no numba import (numba's import and cache load took
longer than the whole C++ build there).

Facts reproduced (megatron-core 0.16.1, gpt_dataset.py / helpers.cpp / blended_dataset.py):
- document index: the split's document ids repeated once per epoch, cast to int32 and shuffled in place with
  the split's `numpy.random.RandomState(seed)`; with a separate final epoch the first `epochs - 1` epochs are
  shuffled together and the final epoch on its own, in that order, from the same RandomState.
- sample index: (num_samples + 1, 2) rows of (position in the document index, token offset). Sample k starts
  at token k * seq_length of the concatenated documents and spans seq_length + extra tokens, so neighbours
  overlap by the extra token. With extra = 1 a boundary at token p lies in the document containing token p;
  with extra = 0 in the first document whose end is >= p. When the last partial sample is kept, its end row is
  (last position, length of the last document - extra). int32 unless an id or length needs int64.
- shuffle index: arange(num_samples) (uint32, int64 when huge) shuffled, then, when the final epoch is
  separate, arange(num_samples, total) shuffled on its own, from the same RandomState after the documents.
- blending: at each step pick the first dataset with the largest `weight * max(step, 1) - taken` (a
  deterministic choice: blending never shuffles).
Ours: `random_state=None` builds the unshuffled indices (training.disable_shuffling / --no-shuffle): the
documents in order, epoch after epoch, and the identity shuffle index, with no random draws.
"""
from __future__ import annotations

import math
import sys
from typing import Optional, Sequence, Tuple

import numpy


# numba's import and the load of its cached kernels cost 0.4-0.9 s once per process (llvmlite's start-up), and
# the kernels save ~20-40 ns per entry over numpy (megatron-core's own shuffle; a linear-time numpy sample
# index). Fresh processes, 1M documents and 2M samples (`benchmarks/bench_index_build.py --first-use-doc-tokens`),
# wall time against megatron-core's C++: a 6M-entry document index 1.51x with numba loaded, 0.97x in numpy;
# 16M entries 0.99x either way; 23M 0.67x with numba, 0.85x in numpy. So numba is loaded only for arrays of at
# least NUMBA_FROM entries; once a process has it loaded (a larger data set came first), arrays from
# NUMBA_LOADED_FROM entries on take it too.
NUMBA_FROM = 1 << 24
NUMBA_LOADED_FROM = 1 << 22


def _numba_pays(entries: int) -> bool:
    if entries >= NUMBA_FROM:
        return True
    return entries >= NUMBA_LOADED_FROM and "megatron_compat.data.index_kernels" in sys.modules


def shuffle(array: numpy.ndarray, random_state: numpy.random.RandomState) -> None:
    """`random_state.shuffle(array)` (the same permutation, the same generator state after it) for a 1-D
    array: numpy's own unless `_numba_pays`, else the numba kernel `index_kernels.shuffle_in_place` on
    the RandomState's own MT19937 (2x faster for 4-byte ids)."""
    if array.ndim != 1 or not array.flags.c_contiguous or len(array) < 2 or not _numba_pays(len(array)):
        random_state.shuffle(array)
        return
    from megatron_compat.data.index_kernels import shuffle_in_place

    bit_generator = random_state._bit_generator  # numpy's documented route for numba (ctypes interface)
    interface = bit_generator.ctypes
    with bit_generator.lock:
        shuffle_in_place(array, interface.next_uint32, interface.next_uint64, interface.state_address)


def build_document_index(documents: numpy.ndarray, num_epochs: int,
                         random_state: Optional[numpy.random.RandomState], separate_final_epoch: bool
                         ) -> numpy.ndarray:
    """The shuffled int32 document ids, `num_epochs` times over (see the module docstring for the order);
    in their given order when `random_state` is None."""
    # One int32 array; a shuffle's draws depend only on the length, so shuffling its first (epochs - 1)
    # epochs and then its final epoch in place equals megatron-core's two shuffled copies concatenated.
    document_index = numpy.tile(numpy.asarray(documents).astype(numpy.int32, copy=False), num_epochs)
    if random_state is not None:
        if separate_final_epoch and num_epochs > 1:
            split_at = (num_epochs - 1) * len(documents)
            shuffle(document_index[:split_at], random_state)
            shuffle(document_index[split_at:], random_state)
        else:
            shuffle(document_index, random_state)
    return document_index


def num_samples_in(num_epochs: int, tokens_per_epoch: int, seq_length: int, drop_last_partial_sequence: bool,
                   add_extra_token: int) -> int:
    """How many samples the sample index holds; the kept-partial case divides in float32, as helpers.cpp does."""
    usable = num_epochs * tokens_per_epoch - add_extra_token
    if drop_last_partial_sequence:
        return usable // seq_length
    return int(math.ceil(numpy.float32(usable) / numpy.float32(seq_length)))


def build_sample_index(sizes: numpy.ndarray, document_index: numpy.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                       add_extra_token_to_sequence: bool = True) -> numpy.ndarray:
    """The (num_samples + 1, 2) sample index: per boundary, a position in `document_index` and an offset;
    int32 unless a position or a document length needs int64 (megatron-core's rule)."""
    extra = 1 if add_extra_token_to_sequence else 0
    num_samples = num_samples_in(num_epochs, tokens_per_epoch, seq_length, drop_last_partial_sequence, extra)
    max_value = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    dtype = numpy.int32 if max_value <= numpy.iinfo(numpy.int32).max else numpy.int64
    sample_index = numpy.empty((num_samples + 1, 2), dtype=dtype)
    if not _numba_pays(max(len(document_index), num_samples)):
        _fill_sample_index_numpy(numpy.asarray(sizes), numpy.asarray(document_index), int(seq_length), extra,
                                 sample_index)
    else:
        from megatron_compat.data.index_kernels import fill_sample_index

        fill_sample_index(numpy.asarray(sizes), numpy.asarray(document_index), int(seq_length), extra, sample_index)
    return sample_index


def _fill_sample_index_numpy(sizes, document_index, seq_length: int, extra: int, out: numpy.ndarray) -> None:
    """`index_kernels.fill_sample_index` in linear-time numpy (int64 temporaries of the document index's
    length): sample k starts at token p = k * seq_length, in the first position i whose running end cum[i]
    is >= p + extra, at offset p - cum[i - 1]; past the last document, at (last position, its length - extra).
    The first position of each boundary is counted, not searched: #{i : cum[i] < p_k + extra} =
    #{i : (cum[i] - extra) // seq_length < k}, a bincount's running sum."""
    rows = out.shape[0]
    n = len(document_index)
    # ends[i + 1] = tokens up to the end of position i, built in place (one int64 array of the document
    # index's length, no gather or concatenation temporaries: 0.6x the time of cumsum(sizes[index]) + concat)
    ends = numpy.empty(n + 1, dtype=numpy.int64)
    ends[0] = 0
    numpy.take(sizes.astype(numpy.int64, copy=False), document_index, out=ends[1:], mode="clip")
    numpy.cumsum(ends[1:], out=ends[1:])
    below = ends[1:] - extra  # >= -1, so below // seq_length + 1 >= 0
    below //= seq_length
    below += 1
    numpy.minimum(below, rows, out=below)
    position = numpy.bincount(below, minlength=rows + 1)[:rows]
    del below
    numpy.cumsum(position, out=position)  # non-decreasing, at most n
    offset = numpy.arange(0, rows * seq_length, seq_length, dtype=numpy.int64)
    offset -= numpy.take(ends, position, mode="clip")
    del ends
    if rows and position[-1] >= n:  # a kept partial last sample runs out of documents
        past = position >= n
        position[past] = n - 1
        offset[past] = int(sizes[document_index[-1]]) - extra
    out[:, 0] = position
    out[:, 1] = offset
    out[0] = 0


def build_shuffle_index(num_samples: int, total_size: int, random_state: Optional[numpy.random.RandomState]
                        ) -> numpy.ndarray:
    """arange(total_size) (uint32, int64 when huge) with [0, num_samples) and [num_samples, total_size)
    shuffled separately, in place; the identity when `random_state` is None."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    shuffle_index = numpy.arange(total_size, dtype=dtype)
    if random_state is not None:
        shuffle(shuffle_index[:num_samples], random_state)
        if num_samples < total_size:
            shuffle(shuffle_index[num_samples:], random_state)
    return shuffle_index


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of `size` greedy picks in proportion to `weights`."""
    from megatron_compat.data.index_kernels import fill_blending_indices

    dataset_index = numpy.empty(size, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(size, dtype=numpy.int64)
    fill_blending_indices(numpy.asarray(weights, dtype=numpy.float64), dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Greedy picks that take exactly sizes[d] samples from each dataset d, in proportion to the sizes."""
    from megatron_compat.data.index_kernels import fill_exhaustive_blending_indices

    sizes = numpy.asarray([int(s) for s in sizes], dtype=numpy.int64)
    total = int(sizes.sum())
    dataset_index = numpy.empty(total, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(total, dtype=numpy.int64)
    fill_exhaustive_blending_indices(sizes, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index
