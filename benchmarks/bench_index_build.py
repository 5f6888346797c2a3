"""GPTDataset index building: ours (numpy) against megatron-core 0.16.1 (its numpy document/shuffle index and
C++ `build_sample_idx`), on 1M documents, sequence length 4096, 2M samples, measured in the same run; then the
BlendedDataset blending index (ours: a Python loop; megatron-core: C++ `build_blending_indices`).

Run: python benchmarks/bench_index_build.py [--docs 1000000] [--seq 4096] [--samples 2000000] [--repeats 3]
         [--blend-samples 1000000] [--blend-datasets 3]
Prints each stage's best-of-N time for both, the ratio ours / megatron-core, and checks the indices are equal.
"""
from __future__ import annotations

import argparse
import time
import warnings

import numpy

from megatron_compat.data import index_building


def _epochs(tokens_per_epoch: int, num_samples: int, seq: int) -> int:
    return max(1, -(-(num_samples * seq + 1) // tokens_per_epoch))


def ours(sizes, documents, seq, num_samples, seed):
    tokens = int(sizes.sum())
    epochs = _epochs(tokens, num_samples, seq)
    state = numpy.random.RandomState(seed)
    t0 = time.perf_counter()
    doc = index_building.build_document_index(documents, epochs, state, False)
    t1 = time.perf_counter()
    sample = index_building.build_sample_index(sizes, doc, seq, epochs, tokens, True, True)
    t2 = time.perf_counter()
    shuffle = index_building.build_shuffle_index(len(sample) - 1, len(sample) - 1, state)
    t3 = time.perf_counter()
    return (doc, sample, shuffle), (t1 - t0, t2 - t1, t3 - t2)


def megatron(sizes, documents, seq, num_samples, seed):
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    tokens = int(sizes.sum())
    epochs = _epochs(tokens, num_samples, seq)
    state = numpy.random.RandomState(seed)
    t0 = time.perf_counter()
    doc = _build_document_index(documents, epochs, state, False)
    t1 = time.perf_counter()
    sample = helpers.build_sample_idx(sizes, doc, seq, epochs, tokens, True, True)
    t2 = time.perf_counter()
    shuffle = _build_shuffle_index(len(sample) - 1, len(sample) - 1, state)
    t3 = time.perf_counter()
    return (doc, sample, shuffle), (t1 - t0, t2 - t1, t3 - t2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--blend-samples", type=int, default=1_000_000)
    parser.add_argument("--blend-datasets", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    sizes = numpy.random.default_rng(0).integers(1, 2048, args.docs).astype(numpy.int32)
    documents = numpy.arange(args.docs, dtype=numpy.int32)
    print(f"{args.docs} documents ({int(sizes.sum())} tokens), seq {args.seq}, {args.samples} samples, "
          f"{_epochs(int(sizes.sum()), args.samples, args.seq)} epochs; best of {args.repeats}")
    best = {}
    for name, fn in (("megatron-core", megatron), ("ours", ours)):
        runs = [fn(sizes, documents, args.seq, args.samples, 1234) for _ in range(args.repeats)]
        best[name] = [min(r[1][i] for r in runs) for i in range(3)]
        best[name + "-total"] = min(sum(r[1]) for r in runs)
        best[name + "-arrays"] = runs[0][0]
    for a, b in zip(best["megatron-core-arrays"], best["ours-arrays"]):
        assert a.dtype == b.dtype and numpy.array_equal(a, b), "indices differ from megatron-core"
    print(f"{'stage':<16}{'megatron-core s':>16}{'ours s':>10}{'ratio':>8}")
    for i, stage in enumerate(("document index", "sample index", "shuffle index")):
        m, o = best["megatron-core"][i], best["ours"][i]
        print(f"{stage:<16}{m:>16.3f}{o:>10.3f}{o / m:>8.2f}")
    m, o = best["megatron-core-total"], best["ours-total"]
    print(f"{'total':<16}{m:>16.3f}{o:>10.3f}{o / m:>8.2f}   (ours / megatron-core; indices identical)")
    blending(args.blend_samples, args.blend_datasets)


def blending(size: int, num_datasets: int) -> None:
    from megatron.core.datasets import helpers

    weights = numpy.random.default_rng(1).random(num_datasets) + 0.1
    weights = (weights / weights.sum()).tolist()
    expected = (numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64))
    t0 = time.perf_counter()
    helpers.build_blending_indices(*expected, weights, num_datasets, size, False)
    t1 = time.perf_counter()
    got = index_building.build_blending_indices(weights, size)
    t2 = time.perf_counter()
    assert all(numpy.array_equal(e, g) for e, g in zip(expected, got)), "blending indices differ"
    m, o = t1 - t0, t2 - t1
    print(f"{'blending index':<16}{m:>16.3f}{o:>10.3f}{o / m:>8.1f}   ({num_datasets} datasets, {size} samples; "
          "identical)")


if __name__ == "__main__":
    main()
