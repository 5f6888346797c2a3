"""Dataset index building at cluster scale: ours (megatron_compat.data.index_building: numpy shuffles, numba
loops) against megatron-core 0.16.1 (its numpy document/shuffle index, its C++ `helpers.cpp` sample and
blending index), time and peak memory, measured in the same run, on identical inputs, with identical results.

Run: python benchmarks/bench_index_build.py [--sizes 1000000,10000000,100000000] [--seq 4096]
         [--blend-datasets 20] [--repeats 3] [--stages "document index,sample index,shuffle index,blending index"]

Per size S (samples): documents with lengths uniform in [1, 2 * seq) (mean ~ seq), S / 4 of them, so the
document index spans ~4 epochs (~S entries); the sample index holds S samples; the shuffle index S; the
blending index S picks among `--blend-datasets` datasets. Every (implementation, stage, size) runs in a
fresh process: inputs are made (the same way for both), the numba kernels are compiled (or loaded from
their cache) on a tiny input, freed heap is returned and the peak-RSS mark reset (/proc/self/clear_refs),
then the stage runs once: peak = the process's high-water RSS above what it held before the stage, outputs
included (the C++ helpers' allocations are invisible to tracemalloc, not to RSS). `--repeats` rounds
alternate the two implementations (this machine is shared: both see the same load); the best time counts.
Results are compared by a digest of their bytes, shape and dtype. Prints one table: wall seconds and MiB for
both, ours / megatron-core, and the process CPU seconds with their ratio (every stage is single-threaded on
both sides, so on a loaded machine the CPU-time ratio is the steadier figure).

`first use` rows (`--first-use 2000000`): the three GPTDataset indices (document, sample, shuffle) of that many
samples over samples / 2 documents (of 1..2 x seq tokens, or `--first-use-doc-tokens`), as a training process's first dataset builds them: torch and the dataset
modules already imported, the time of what the build loads on first use included (megatron-core's C++ helpers
module; our numba kernels only from index_building.NUMBA_FROM entries on).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings

import numpy


STAGES = ("document index", "sample index", "shuffle index", "blending index")
# All three GPTDataset indices in a fresh process, what the build loads on first use included (`--first-use
# SAMPLES`: documents = samples / 2, about two epochs).
FIRST_USE = "first use"
SEED = 1234


def _inputs(size: int, seq: int, docs_per_sample: int = 4, max_doc_tokens: int = 0):
    num_docs = max(size // docs_per_sample, 1000)
    sizes = numpy.random.default_rng(0).integers(1, max_doc_tokens or 2 * seq, num_docs).astype(numpy.int32)
    documents = numpy.arange(num_docs, dtype=numpy.int32)
    tokens = int(sizes.sum())
    epochs = max(1, -(-(size * seq + 1) // tokens))
    return sizes, documents, tokens, epochs


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _reset_peak() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap goes back: neither side reuses the other's setup memory
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _stage(impl: str, stage: str, size: int, seq: int, blend_datasets: int, max_doc_tokens: int = 0):
    """(a callable running the stage once, a description of its output for the digest)."""
    from megatron_compat.data import index_building as ib

    sizes, documents, tokens, epochs = (_inputs(size, seq, 2, max_doc_tokens) if stage == FIRST_USE
                                        else _inputs(size, seq))
    weights = numpy.random.default_rng(1).random(blend_datasets) + 0.1
    weights = (weights / weights.sum()).tolist()
    # the same input for both (the document indices are identical), made the same way
    document_index = (ib.build_document_index(documents, epochs, numpy.random.RandomState(SEED), False)
                      if stage == "sample index" else None)
    if stage == FIRST_USE:
        return _first_use(impl, sizes, documents, tokens, epochs, seq, size)
    if impl == "ours":
        # compile (or load from numba's cache) on a tiny input, outside the measurement (numba forced: at the
        # sizes measured here the kernels run; smaller index arrays never load numba, see FIRST_USE)
        threshold, ib.NUMBA_FROM = ib.NUMBA_FROM, 0
        ib.build_sample_index(sizes[:100], documents[:100], 8, 1, int(sizes[:100].sum()), True, True)
        ib.build_blending_indices(weights, 100)
        for dtype in (numpy.int32, numpy.uint32):  # the shuffle kernel's two specialisations
            ib.shuffle(numpy.arange(10, dtype=dtype), numpy.random.RandomState(0))
        ib.NUMBA_FROM = threshold
        run = {
            "document index": lambda: ib.build_document_index(documents, epochs, numpy.random.RandomState(SEED),
                                                              False),
            "sample index": lambda: ib.build_sample_index(sizes, document_index, seq, epochs, tokens, True, True),
            "shuffle index": lambda: ib.build_shuffle_index(size, size, numpy.random.RandomState(SEED)),
            "blending index": lambda: ib.build_blending_indices(weights, size),
        }[stage]
    else:
        from megatron.core.datasets import helpers
        from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

        def blend():
            out = (numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64))
            helpers.build_blending_indices(*out, weights, blend_datasets, size, False)
            return out

        run = {
            "document index": lambda: _build_document_index(documents, epochs, numpy.random.RandomState(SEED),
                                                            False),
            "sample index": lambda: helpers.build_sample_idx(sizes, document_index, seq, epochs, tokens, True,
                                                             True),
            "shuffle index": lambda: _build_shuffle_index(size, size, numpy.random.RandomState(SEED)),
            "blending index": blend,
        }[stage]
    return run


def _first_use(impl, sizes, documents, tokens, epochs, seq, size):
    """GPTDataset's three indices as its first use in a training process builds them: the dataset modules are
    imported (and torch with them) outside the measurement; inside it, whatever the build loads on first use
    (megatron-core's C++ helpers module; our numba, when the arrays are large enough to need it)."""
    if impl == "ours":
        from megatron_compat.data import gpt_dataset  # noqa: F401 - what a training process has imported

        def run():
            from megatron_compat.data import index_building as ib

            state = numpy.random.RandomState(SEED)
            document_index = ib.build_document_index(documents, epochs, state, False)
            sample_index = ib.build_sample_index(sizes, document_index, seq, epochs, tokens, True, True)
            return document_index, sample_index, ib.build_shuffle_index(len(sample_index) - 1,
                                                                        len(sample_index) - 1, state)
    else:
        from megatron.core.datasets import gpt_dataset

        def run():
            from megatron.core.datasets import helpers

            state = numpy.random.RandomState(SEED)
            document_index = gpt_dataset._build_document_index(documents, epochs, state, False)
            sample_index = helpers.build_sample_idx(sizes, document_index, seq, epochs, tokens, True, True)
            return document_index, sample_index, gpt_dataset._build_shuffle_index(len(sample_index) - 1,
                                                                                  len(sample_index) - 1, state)
    return run


def _digest(result) -> str:
    arrays = result if isinstance(result, tuple) else (result,)
    h = hashlib.sha1()
    for a in arrays:
        h.update(str((a.dtype, a.shape)).encode())
        h.update(memoryview(numpy.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


def child(impl: str, stage: str, size: int, seq: int, blend_datasets: int, digest: bool,
          max_doc_tokens: int = 0) -> None:
    warnings.filterwarnings("ignore")
    run = _stage(impl, stage, size, seq, blend_datasets, max_doc_tokens)
    _reset_peak()
    before = _kib("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    result = run()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak_mib = (_kib("VmHWM") - before) / 1024
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "peak_mib": peak_mib,
                      "digest": _digest(result) if digest else None}))


def _measure(impl, stage, size, args, digest):
    out = subprocess.run([sys.executable, __file__, "--child", impl, stage, str(size), "--seq", str(args.seq),
                          "--blend-datasets", str(args.blend_datasets), "--first-use-doc-tokens",
                          str(args.first_use_doc_tokens), *(["--digest"] if digest else [])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best_of(stage, size, args):
    """Rounds alternate megatron-core and ours, each in a fresh process, so that both see the same machine
    load (this machine is shared); the best time of each, the peak memory and digest of the first round."""
    results = {"megatron-core": [], "ours": []}
    for round_ in range(args.repeats):
        for impl in results:
            results[impl].append(_measure(impl, stage, size, args, digest=round_ == 0))
    return [dict(runs[0], seconds=min(r["seconds"] for r in runs), cpu_seconds=min(r["cpu_seconds"] for r in runs))
            for runs in results.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000000,10000000,100000000", help="samples, comma-separated")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--blend-datasets", type=int, default=20)
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset of: " + ", ".join(STAGES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds per measurement (best time)")
    parser.add_argument("--first-use", default="2000000", help="samples (comma-separated) of the 'first use' rows: "
                        "the three GPTDataset indices in a fresh process, load of numba / the C++ helpers included "
                        "('' for none)")
    parser.add_argument("--first-use-doc-tokens", type=int, default=0,
                        help="documents of 1..N-1 tokens in the 'first use' rows (default 2 x seq: ~2 epochs; 3000 at "
                        "seq 4096: ~6 epochs, a 6M-entry document index, where loading numba would not pay)")
    parser.add_argument("--digest", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "STAGE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        impl, stage, size = args.child
        child(impl, stage, int(size), args.seq, args.blend_datasets, args.digest, args.first_use_doc_tokens)
        return
    print(f"seq {args.seq}; documents of 1..{2 * args.seq - 1} tokens, samples / 4 of them; blend of "
          f"{args.blend_datasets} datasets; best of {args.repeats}; peak = RSS high-water above the inputs")
    print(f"{'samples':>12} {'stage':<15}{'mcore s':>9}{'ours s':>9}{'time x':>8}{'mcore MiB':>11}"
          f"{'ours MiB':>10}{'mem x':>7}{'mcore cpu':>11}{'ours cpu':>10}{'cpu x':>7}  identical")
    rows = [(int(size), stage.strip()) for size in args.sizes.split(",") if size for stage in args.stages.split(",")]
    rows += [(int(size), FIRST_USE) for size in args.first_use.split(",") if size]
    for size, stage in rows:
        m, o = _best_of(stage, size, args)
        same = m["digest"] == o["digest"]
        print(f"{size:>12} {stage:<15}{m['seconds']:>9.3f}{o['seconds']:>9.3f}"
              f"{o['seconds'] / m['seconds']:>8.2f}{m['peak_mib']:>11.1f}{o['peak_mib']:>10.1f}"
              f"{o['peak_mib'] / max(m['peak_mib'], 0.1):>7.2f}{m['cpu_seconds']:>11.3f}{o['cpu_seconds']:>10.3f}"
              f"{o['cpu_seconds'] / max(m['cpu_seconds'], 1e-9):>7.2f}  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
