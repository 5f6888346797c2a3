"""The index arrays behind GPTDataset and BlendedDataset, built with numpy instead of megatron-core's C++
helpers (`helpers.cpp`), with identical results.

Why our own: megatron-core compiles a C++ extension for these loops; a drop-in must not need a compiler or
megatron-core at run time. The GPT indices vectorise (per cache-sized chunk of the document index, a
cumulative token count and one `searchsorted` replace the per-document walk); the blending indices are an inherently sequential greedy choice and run as a
tight Python loop over Python floats, which round exactly like the C++ doubles.

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
from typing import List, Optional, Sequence, Tuple

import numpy


def build_document_index(documents: numpy.ndarray, num_epochs: int,
                         random_state: Optional[numpy.random.RandomState], separate_final_epoch: bool
                         ) -> numpy.ndarray:
    """The shuffled int32 document ids, `num_epochs` times over (see the module docstring for the order);
    in their given order when `random_state` is None."""
    if separate_final_epoch and num_epochs > 1 and random_state is not None:
        first = build_document_index(documents, num_epochs - 1, random_state, False)
        last = build_document_index(documents, 1, random_state, False)
        return numpy.concatenate((first, last))
    # The shuffle's random draws depend only on the length, so shuffling int32 ids equals megatron's
    # shuffle of its int32 copy of an int64 grid.
    document_index = numpy.tile(numpy.asarray(documents).astype(numpy.int32, copy=False), num_epochs)
    if random_state is not None:
        random_state.shuffle(document_index)
    return document_index


def num_samples_in(num_epochs: int, tokens_per_epoch: int, seq_length: int, drop_last_partial_sequence: bool,
                   add_extra_token: int) -> int:
    """How many samples the sample index holds; the kept-partial case divides in float32, as helpers.cpp does."""
    usable = num_epochs * tokens_per_epoch - add_extra_token
    if drop_last_partial_sequence:
        return usable // seq_length
    return int(math.ceil(numpy.float32(usable) / numpy.float32(seq_length)))


_CHUNK_DOCUMENTS = 1 << 18  # documents per pass: keeps each pass's arrays in cache (2-3x faster than whole)


def build_sample_index(sizes: numpy.ndarray, document_index: numpy.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int, drop_last_partial_sequence: bool = True,
                       add_extra_token_to_sequence: bool = True) -> numpy.ndarray:
    """The (num_samples + 1, 2) sample index: per boundary, a position in `document_index` and an offset."""
    extra = 1 if add_extra_token_to_sequence else 0
    num_samples = num_samples_in(num_epochs, tokens_per_epoch, seq_length, drop_last_partial_sequence, extra)
    max_value = max(len(document_index), int(sizes.max()) if len(sizes) else 0)
    dtype = numpy.int32 if max_value <= numpy.iinfo(numpy.int32).max else numpy.int64
    sample_index = numpy.zeros((num_samples + 1, 2), dtype=dtype)
    filled, tokens_before = 0, 0
    for first in range(0, len(document_index), _CHUNK_DOCUMENTS):
        lengths = sizes[document_index[first:first + _CHUNK_DOCUMENTS]]
        doc_ends = numpy.cumsum(lengths, dtype=numpy.int64)  # tokens up to and including each document
        doc_ends += tokens_before
        tokens_before = int(doc_ends[-1])
        # Boundaries k * seq_length whose (k * seq_length + extra)-th token falls in this chunk.
        last_k = min(num_samples, (tokens_before - extra) // seq_length)
        if last_k > filled:
            starts = numpy.arange(filled + 1, last_k + 1, dtype=numpy.int64) * seq_length
            position = numpy.searchsorted(doc_ends, starts + extra, side="left")
            sample_index[filled + 1:last_k + 1, 0] = position + first
            sample_index[filled + 1:last_k + 1, 1] = starts - (doc_ends[position] - lengths[position])
            filled = last_k
    if filled < num_samples:  # the kept partial sample ends past the documents: helpers.cpp's end row
        last = len(document_index) - 1
        sample_index[filled + 1:, 0] = last
        sample_index[filled + 1:, 1] = int(sizes[document_index[last]]) - extra
    return sample_index


def build_shuffle_index(num_samples: int, total_size: int, random_state: Optional[numpy.random.RandomState]
                        ) -> numpy.ndarray:
    """arange(total_size) with [0, num_samples) and [num_samples, total_size) shuffled separately; the
    identity when `random_state` is None."""
    dtype = numpy.uint32 if total_size < numpy.iinfo(numpy.uint32).max - 1 else numpy.int64
    if random_state is None:
        return numpy.arange(total_size, dtype=dtype)
    first = numpy.arange(num_samples, dtype=dtype)
    random_state.shuffle(first)
    if num_samples == total_size:
        return first
    last = numpy.arange(num_samples, total_size, dtype=dtype)
    random_state.shuffle(last)
    return numpy.concatenate((first, last))


_BLEND_CHUNK = 1 << 16  # steps collected in Python lists before they move into the arrays (flat memory)


def build_blending_indices(weights: Sequence[float], size: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """(dataset_index int16, dataset_sample_index int64) of `size` greedy picks in proportion to `weights`."""
    w = [float(x) for x in weights]
    others = range(1, len(w))
    taken = [0] * len(w)
    dataset_index = numpy.empty(size, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(size, dtype=numpy.int64)
    for first in range(0, size, _BLEND_CHUNK):
        picks: List[int] = []
        counts: List[int] = []
        for step in range(first, min(size, first + _BLEND_CHUNK)):
            x = float(step) if step > 1 else 1.0
            best, best_error = 0, w[0] * x - taken[0]
            for d in others:  # strict '>': the first maximum wins, as in helpers.cpp
                error = w[d] * x - taken[d]
                if error > best_error:
                    best, best_error = d, error
            picks.append(best)
            counts.append(taken[best])
            taken[best] += 1
        dataset_index[first:first + len(picks)] = picks
        dataset_sample_index[first:first + len(counts)] = counts
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Greedy picks that take exactly sizes[d] samples from each dataset d, in proportion to the sizes."""
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    w = [s / float(total) for s in sizes]
    taken = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    dataset_index = numpy.empty(total, dtype=numpy.int16)
    dataset_sample_index = numpy.empty(total, dtype=numpy.int64)
    for first in range(0, total, _BLEND_CHUNK):
        picks: List[int] = []
        counts: List[int] = []
        for step in range(first, min(total, first + _BLEND_CHUNK)):
            x = float(step) if step > 1 else 1.0
            best, best_error = -1, -math.inf
            for d in unspent:  # ascending ids, strict '>': the first maximum wins
                error = w[d] * x - taken[d]
                if error > best_error:
                    best, best_error = d, error
            picks.append(best)
            counts.append(taken[best])
            taken[best] += 1
            if taken[best] == sizes[best]:
                unspent.remove(best)
        dataset_index[first:first + len(picks)] = picks
        dataset_sample_index[first:first + len(counts)] = counts
    return dataset_index, dataset_sample_index
