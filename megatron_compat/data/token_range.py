"""The range of token ids in a `.bin` (computed once, cached beside the `.idx`) and the check of a dataset
against the run's vocabulary: an id at or above the vocabulary size would otherwise surface as an
IndexError deep in the embedding (a device-side assert on GPU), long after start.

Cache: `<prefix>.token_range` (a name Megatron's tools/merge_datasets.py passes over: same prefix, and its
`.idx` exists), one line `<bin size> <bin mtime_ns> <min id> <max id>`; a stale or
unreadable cache is recomputed; when the data folder is read-only the cache goes to a fallback folder (the
run's --data-cache-path), and without one the range is computed each run. Scanning logs Megatron-style lines.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import List, Optional, Tuple

import numpy

from fsdp2_backend.checkpoint.atomic import write_atomically
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data.indexed_dataset import _IndexReader, get_bin_path, get_idx_path

logger = logging.getLogger(__name__)

_CHUNK = 1 << 26  # tokens per reduction step: bounded page-cache pressure on huge files


def _cache_paths(path_prefix: str, fallback_dir: Optional[str]) -> List[str]:
    paths = [f"{path_prefix}.token_range"]
    if fallback_dir:  # e.g. --data-cache-path, for a read-only data folder
        key = hashlib.md5(os.path.abspath(path_prefix).encode("utf-8"), usedforsecurity=False).hexdigest()
        paths.append(os.path.join(fallback_dir, f"{key}-{os.path.basename(path_prefix)}.token_range"))
    return paths


def token_range(path_prefix: str, fallback_dir: Optional[str] = None) -> Tuple[int, int]:
    """(smallest, largest) token id in the `.bin` of `path_prefix`; (0, -1) when it holds no tokens. The
    cache is read from and written to `<prefix>.token_range`, else to `fallback_dir`."""
    idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
    stat = os.stat(bin_path)
    stamp = f"{stat.st_size} {stat.st_mtime_ns}"
    caches = _cache_paths(path_prefix, fallback_dir)
    for cache in caches:
        try:
            with open(cache) as f:
                size, mtime, low, high = f.read().split()
            if f"{size} {mtime}" == stamp:
                return int(low), int(high)
        except (OSError, ValueError):
            pass
    dtype = _IndexReader(idx_path, multimodal=False).dtype
    logger.info("> checking the token ids of %s against the vocabulary (%d tokens, once: the range is cached)",
                bin_path, stat.st_size // numpy.dtype(dtype).itemsize)
    started = time.time()
    tokens = numpy.memmap(bin_path, dtype=dtype, mode="r") if stat.st_size else numpy.zeros(0, dtype)
    low, high = 0, -1
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        low = int(chunk.min()) if start == 0 else min(low, int(chunk.min()))
        high = max(high, int(chunk.max()))
    del tokens
    logger.info("\t> time elapsed: %4f seconds", time.time() - started)
    for cache in caches:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(cache)), exist_ok=True)
            write_atomically(cache, f"{stamp} {low} {high}\n")
            break
        except OSError:
            continue  # a read-only folder: try the next, else recomputed next time
    return low, high


def check_token_ids(path_prefix: str, vocab_size: int, fallback_dir: Optional[str] = None) -> None:
    """UsageError naming the file when an id lies outside [0, vocab_size)."""
    low, high = token_range(path_prefix, fallback_dir)
    if high >= vocab_size or low < 0:
        bad = high if high >= vocab_size else low
        raise UsageError(f"{get_bin_path(path_prefix)}: token id {bad} is outside the tokenizer's vocabulary "
                         f"(size {vocab_size}) — the data was tokenized with another tokenizer; preprocess it "
                         "with this run's tokenizer or train with the one it was made with")
