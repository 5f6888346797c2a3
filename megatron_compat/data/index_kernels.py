"""The two sequential index loops behind GPTDataset and BlendedDataset, compiled with numba.

Why numba: the sample index walk and the greedy blending choice are sequential (each step depends on the
last), so numpy cannot express them without several full-size temporaries, and a Python loop is 30x slower
than megatron-core's C++ `helpers.cpp`. numba compiles them at first use from a wheel (no compiler on the
user's machine, no build step at install); `cache=True` keeps the machine code under `__pycache__` (or
numba's user cache folder when that is read-only), so later runs load it in milliseconds.

The arithmetic is the C++ helpers': int64 token counters, and for blending IEEE doubles in the same order
(`weight * max(step, 1.0) - taken`, no fused multiply-add, strict `>` so the first maximum wins), which is
why the results are bit-identical. Callers allocate the outputs (with megatron-core's dtypes) and these
kernels only fill them: no temporaries.
"""
from __future__ import annotations

import numpy
from numba import njit


# Document lengths are read through a small buffer refilled a block at a time: the lengths of consecutive
# positions are random reads (document_index is shuffled), and a tight gather loop lets the CPU overlap
# those cache misses, where the walk below (a branch on every length) cannot. 0.65-0.7x megatron-core's
# C++ time at 100M samples instead of ~1.2x, for 32 KiB.
_SIZE_BLOCK = 4096


@njit(cache=True, nogil=True)
def _gather_sizes(sizes, document_index, start, buffer):  # pragma: no cover - compiled
    count = min(buffer.shape[0], document_index.shape[0] - start)
    for i in range(count):
        buffer[i] = sizes[document_index[start + i]]


@njit(cache=True, nogil=True)
def fill_sample_index(sizes, document_index, seq_length, extra, out):  # pragma: no cover - compiled
    """out[k] = (position in document_index, token offset) where sample k starts; out[0] = (0, 0). A sample
    spans seq_length + extra tokens, and the next one starts `extra` tokens before this one ends. When the
    documents run out (a kept partial last sample), the end row is (last position, its length - extra)."""
    last = document_index.shape[0] - 1
    buffer = numpy.empty(_SIZE_BLOCK, dtype=numpy.int64)
    start = 0  # buffer[i] is the length of the document at position start + i
    _gather_sizes(sizes, document_index, start, buffer)
    position = 0
    offset = 0
    size = buffer[0]
    out[0, 0] = 0
    out[0, 1] = 0
    for k in range(1, out.shape[0]):
        need = seq_length + extra
        while True:
            available = size - offset
            if available >= need:  # this document completes the sample
                offset += need - extra
                break
            need -= available
            if position == last:
                offset = size - extra
                break
            position += 1
            if position - start == _SIZE_BLOCK:
                start = position
                _gather_sizes(sizes, document_index, start, buffer)
            size = buffer[position - start]
            offset = 0
        out[k, 0] = position
        out[k, 1] = offset


@njit(cache=True, nogil=True)
def fill_blending_indices(weights, dataset_index, dataset_sample_index):  # pragma: no cover - compiled
    """Step by step, the first dataset with the largest weight * max(step, 1) - taken; its running count is
    the sample it gives."""
    num = weights.shape[0]
    # counts kept as doubles (exact below 2**53): the C++ converts them for every comparison anyway
    taken = numpy.zeros(num, dtype=numpy.float64)
    errors = numpy.empty(num, dtype=numpy.float64)
    for step in range(dataset_index.shape[0]):
        x = max(float(step), 1.0)
        # two passes, the second without branches: ~0.85x the C++'s single branchy loop in CPU time
        for d in range(num):
            errors[d] = weights[d] * x - taken[d]
        best = 0
        best_error = errors[0]
        for d in range(1, num):
            better = errors[d] > best_error
            best = d if better else best
            best_error = errors[d] if better else best_error
        dataset_index[step] = best
        dataset_sample_index[step] = int(taken[best])
        taken[best] += 1.0


@njit(cache=True, nogil=True)
def fill_exhaustive_blending_indices(sizes, dataset_index, dataset_sample_index):  # pragma: no cover
    """Greedy picks in proportion to `sizes` (weights size / total in doubles) among the datasets not yet
    spent, ascending ids, until each dataset d gave exactly sizes[d] samples."""
    num = sizes.shape[0]
    total = 0
    for d in range(num):
        total += sizes[d]
    weights = numpy.empty(num, dtype=numpy.float64)
    for d in range(num):
        weights[d] = sizes[d] / float(total)
    taken = numpy.zeros(num, dtype=numpy.int64)
    spent = numpy.zeros(num, dtype=numpy.bool_)
    for step in range(dataset_index.shape[0]):
        x = max(float(step), 1.0)
        best = -1
        best_error = -numpy.inf
        for d in range(num):
            if spent[d]:
                continue
            error = weights[d] * x - float(taken[d])
            if best < 0 or error > best_error:
                best = d
                best_error = error
        dataset_index[step] = best
        dataset_sample_index[step] = taken[best]
        taken[best] += 1
        if taken[best] == sizes[best]:
            spent[best] = True


@njit(cache=True, nogil=True)
def shuffle_in_place(x, next_uint32, next_uint64, state):  # pragma: no cover - compiled
    """`numpy.random.RandomState.shuffle(x)` for a 1-D array, drawing from the RandomState's own MT19937
    (its ctypes `next_uint32` / `next_uint64` and state), so the permutation and the generator's state after
    it are numpy's: Fisher-Yates from the end, each position i swapped with numpy's legacy
    `random_interval(i)` (the smallest all-ones mask >= i, redrawn until the masked draw is <= i; 32-bit draws
    while i fits 32 bits). Faster than numpy's own for 4-byte items, whose swaps go through a generic memcpy."""
    one = numpy.uint64(1)
    for i in range(x.shape[0] - 1, 0, -1):
        bound = numpy.uint64(i)
        mask = bound
        mask |= mask >> one
        mask |= mask >> numpy.uint64(2)
        mask |= mask >> numpy.uint64(4)
        mask |= mask >> numpy.uint64(8)
        mask |= mask >> numpy.uint64(16)
        mask |= mask >> numpy.uint64(32)
        if bound <= numpy.uint64(0xFFFFFFFF):
            value = numpy.uint64(next_uint32(state)) & mask
            while value > bound:
                value = numpy.uint64(next_uint32(state)) & mask
        else:
            value = numpy.uint64(next_uint64(state)) & mask
            while value > bound:
                value = numpy.uint64(next_uint64(state)) & mask
        j = numpy.int64(value)
        swap = x[i]
        x[i] = x[j]
        x[j] = swap
