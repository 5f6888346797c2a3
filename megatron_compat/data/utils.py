"""Small shared pieces of the Megatron dataset stack: the Split enum, weight normalisation, Megatron's
blend-list and split-string parsing, the rank queries that decide who builds index caches, and
`rank_zero_first`, the one "the building rank does it first, the others wait" helper (dataset caches here,
tokenized files in `fsdp2_backend.data`), whose barrier spreads a failure to every rank.

Facts reproduced from megatron-core 0.16.1 (`datasets/utils.py`, `blended_megatron_dataset_config.py`):
weights are normalised in float64; a split string keeps every `[.0-9]+` run, pads to three entries with
zeros and normalises; the split matrix holds each split's (begin, end) book-ends, None for an empty one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from enum import Enum
from itertools import accumulate
from typing import Callable, Iterator, List, Optional, Tuple, TypeVar

import numpy

T = TypeVar("T")

class Split(Enum):
    train = 0
    valid = 1
    test = 2


def normalize(weights: List[float]) -> List[float]:
    """Divides by the sum in float64 (megatron-core's rounding, so blends come out identical)."""
    w = numpy.array(weights, dtype=numpy.float64)
    return (w / numpy.sum(w)).tolist()


def get_blend_from_list(blend: Optional[List[str]]) -> Optional[Tuple[List[str], Optional[List[float]]]]:
    """["30", "p1", "70", "p2"] -> (["p1", "p2"], [30.0, 70.0]); ["p1", "p2"] -> (["p1", "p2"], None)."""
    if blend is None:
        return None
    weights: Optional[List[float]] = None
    prefixes = blend
    if len(blend) % 2 == 0:
        try:
            weights = [float(blend[i]) for i in range(0, len(blend), 2)]
            prefixes = [blend[i] for i in range(1, len(blend), 2)]
        except ValueError:
            weights = None  # an even-length list of plain prefixes
    return [p.strip() for p in prefixes], weights


def parse_and_normalize_split(split: str) -> List[float]:
    """"969,30,1" -> [0.969, 0.03, 0.001]; missing entries count as 0."""
    values = [float(v) for v in re.findall(r"[.0-9]+", split)]
    values += [0.0] * (len(Split) - len(values))
    if len(values) != len(Split) or sum(values) <= 0:
        raise ValueError(f"split {split!r}: expected up to three non-negative weights with a positive sum, "
                         f"e.g. '969,30,1'")
    return normalize(values)


def convert_split_vector_to_split_matrix(vector_a: List[float], vector_b: Optional[List[float]] = None
                                         ) -> List[Optional[Tuple[float, float]]]:
    """Book-ends per split, intersected with a second vector's when given; None where a split is empty."""
    vector_b = vector_a if vector_b is None else vector_b
    ends_a = list(accumulate(vector_a, initial=0))
    ends_b = list(accumulate(vector_b, initial=0))
    matrix: List[Optional[Tuple[float, float]]] = []
    for (a0, a1), (b0, b1) in zip(zip(ends_a[:-1], ends_a[1:]), zip(ends_b[:-1], ends_b[1:])):
        lo, hi = max(a0, b0), min(a1, b1)
        matrix.append(None if hi <= lo else (lo, hi))
    return matrix


def _dist():
    """torch.distributed when a process group is up, else None (torch is imported lazily)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a hard dependency of the datasets anyway
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def global_rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def barrier(error: Optional[BaseException] = None, what: str = "data: preparing the datasets") -> None:
    """A barrier over all ranks that also spreads failure: re-raises `error` (this rank's exception, if any),
    and raises on every other rank when some rank failed, so no rank waits forever for a rank that died."""
    dist = _dist()
    if dist is not None:
        import torch

        device = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator()
        failed = torch.tensor([int(error is not None)], device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if error is None and failed.item():
            from fsdp2_backend.usage_errors import UsageError

            raise UsageError(f"{what} failed on another rank (rank {dist.get_rank()} stops too) — see that "
                             "rank's error")
    if error is not None:
        raise error


def distributed() -> bool:
    return _dist() is not None


def builds_caches_first(shared_storage: bool) -> bool:
    """Whether this rank writes index caches for the others: global rank 0 when the cache folder is shared by
    all nodes, otherwise each node's local rank 0 (LOCAL_RANK, as torchrun sets it)."""
    dist = _dist()
    if dist is None:
        return True
    if shared_storage:
        return dist.get_rank() == 0
    return int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0


def rank_zero_first(work: Callable[[], T], shared_storage: bool = True, *, others: bool = True,
                    synchronize: bool = True, what: str = "data: preparing the datasets") -> Optional[T]:
    """Runs `work` on the cache-building rank(s) (`builds_caches_first(shared_storage)`: global rank 0, or each
    node's local rank 0 without shared storage) first; then a `barrier` that hands a failure there to every
    rank; then, when `others`, runs `work` on the remaining ranks (which now find what the first one wrote).
    Returns this rank's result, None where `work` did not run. `synchronize=False` skips the barrier (a caller
    whose ranks are kept in step otherwise): the building rank then raises its own failure at once.
    Without a process group `work` just runs."""
    first = builds_caches_first(shared_storage)
    result: Optional[T] = None
    error: Optional[BaseException] = None
    if first:
        try:
            result = work()
        except Exception as exc:  # reaches the waiting ranks through the barrier
            error = exc
    if synchronize:
        barrier(error, what)
    elif error is not None:
        raise error
    if not first and others:
        result = work()
    return result


@contextlib.contextmanager
def progress_lines(shared_storage: bool = True) -> Iterator[None]:
    """Shows the dataset stack's progress lines (megatron-core's INFO lines: which IndexedDataset is loaded,
    "Build and save the GPTDataset train indices", the time elapsed, the samples and epochs) on stdout, once:
    only on the rank that builds the caches, between Megatron-LM's "> building train, validation, and test
    datasets for GPT ..." and "> finished creating GPT datasets ..."."""
    if not builds_caches_first(shared_storage):
        yield
        return
    data_logger = logging.getLogger("megatron_compat.data")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    old_level, old_propagate = data_logger.level, data_logger.propagate
    data_logger.addHandler(handler)
    data_logger.setLevel(logging.INFO)
    data_logger.propagate = False
    try:
        data_logger.info("> building train, validation, and test datasets for GPT ...")
        yield
        data_logger.info("> finished creating GPT datasets ...")
    finally:
        data_logger.removeHandler(handler)
        data_logger.setLevel(old_level)
        data_logger.propagate = old_propagate
