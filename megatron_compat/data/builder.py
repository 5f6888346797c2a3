"""`BlendedMegatronDatasetBuilder`: megatron-core 0.16.1's builder of the train/valid/test datasets from a blend
(split by the split string) or from per-split blends, with the same constructor and `build()`.

Facts reproduced: a single unweighted prefix gives plain mid-level datasets; weights are normalised, and each
dataset of a weighted blend is asked for ceil(ceil(size * weight) * (1 + mid_level_dataset_surplus)) samples
while the blend itself takes sum(ceil(size * weight)); an unweighted blend weighs datasets by their lengths
(capped at the requested size, exhaustive when None); a split's documents are
[round(begin * n), round(end * n)); per-split blends use the whole dataset for their split; multiple
validation sets give a list. Ranks: the cache-building rank constructs first, a barrier, then the others
(which only load caches) — `utils.rank_zero_first`; ranks for which `is_built_on_rank()` is False get None.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Callable, List, Optional, Type

import numpy

from megatron_compat.data.blended import BlendedDataset
from megatron_compat.data.dataset_config import BlendedMegatronDatasetConfig
from megatron_compat.data.megatron_dataset import MegatronDataset
from megatron_compat.data.utils import (Split, barrier, builds_caches_first, distributed, normalize,
                                     rank_zero_first)

logger = logging.getLogger(__name__)


class BlendedMegatronDatasetBuilder:
    """Builds one top-level dataset (or None) per split; `sizes` are the sample counts per split."""

    def __init__(self, cls: Type[MegatronDataset], sizes: List[Optional[int]], is_built_on_rank: Callable[[], bool],
                 config: BlendedMegatronDatasetConfig) -> None:
        self.cls = cls
        self.sizes = sizes
        self.is_built_on_rank = is_built_on_rank
        self.config = config
        if config.mock:
            return
        for split in Split:
            if config.blend_per_split is None:
                weights = config.blend[1]
            elif config.blend_per_split[split.value] is None:
                continue
            else:
                weights = config.blend_per_split[split.value][1]
            if sizes[split.value] is None and weights is not None:
                raise ValueError(f"the {split.name} split has blend weights but no size")

    def build(self) -> List[Optional[Any]]:
        """Every split's dataset; call on all ranks (it synchronises them)."""
        datasets = self._build_blended_dataset_splits()
        for dataset in datasets:
            if isinstance(dataset, BlendedDataset) and len(dataset) > 0:
                assert dataset.size is None or dataset.size == len(dataset)
            elif isinstance(dataset, MegatronDataset) and len(dataset) > 0:
                assert dataset.num_samples is None or dataset.num_samples <= len(dataset)
        return datasets

    def _build_blended_dataset_splits(self) -> List[Optional[Any]]:
        config = self.config
        if config.mock:
            return self._build_megatron_dataset_splits(None, config.split_matrix, self.sizes)
        if config.blend:
            prefixes, weights = config.blend
            if weights is not None:
                weights = normalize(weights)
            if len(prefixes) == 1 and weights is None:
                return self._build_megatron_dataset_splits(prefixes[0], config.split_matrix, self.sizes)
            return self._blend_each_split(prefixes, weights, config.split_matrix, self.sizes, range(len(Split)))
        datasets: List[Optional[Any]] = [None] * len(Split)
        for i in range(len(Split)):
            blend = config.blend_per_split[i]
            if blend is None:
                continue
            split_spoof: List[Optional[tuple]] = [None] * len(Split)
            split_spoof[i] = (0.0, 1.0)
            sizes_spoof: List[Optional[int]] = [0] * len(Split)
            sizes_spoof[i] = self.sizes[i]
            prefixes, weights = blend
            if weights is not None:
                weights = normalize(weights)
            if len(prefixes) == 1:
                datasets[i] = self._build_megatron_dataset_splits(prefixes[0], split_spoof, sizes_spoof)[i]
            elif config.multiple_validation_sets and i == Split.valid.value:
                if config.full_validation and sizes_spoof[i] is not None:
                    raise ValueError("full_validation needs the validation size None")
                datasets[i] = [self._build_megatron_dataset_splits(p, split_spoof, sizes_spoof)[i] for p in prefixes]
            else:
                datasets[i] = self._blend_each_split(prefixes, weights, split_spoof, sizes_spoof, [i])[i]
        return datasets

    def _blend_each_split(self, prefixes: List[str], weights: Optional[List[float]], split: List[Optional[tuple]],
                          sizes: List[Optional[int]], split_ids) -> List[Optional[Any]]:
        """Mid-level datasets for every prefix, then a BlendedDataset per split in `split_ids`."""
        if weights is None:
            sizes_buffer = [[None] * len(Split) for _ in prefixes]
        else:
            sizes_target = _get_size_per_split_per_dataset(weights, sizes)
            sizes_buffer = _get_size_per_split_per_dataset(weights, sizes, self.config.mid_level_dataset_surplus)
        megatron_datasets = self._build_megatron_datasets_parallel(prefixes, split, sizes_buffer)
        blended: List[Optional[Any]] = [None] * len(Split)
        for i in split_ids:
            if split[i] is None:
                continue
            weights_i: Any = weights
            if weights is not None and self.sizes[i] is not None:
                size_i = sum(per_dataset[i] for per_dataset in sizes_target)
            elif weights is None:
                try:
                    weights_i = [len(d) for d in megatron_datasets[i]]
                except TypeError:  # not built on this rank
                    weights_i = [0 for _ in prefixes]
                size_i = None if self.sizes[i] is None else min(self.sizes[i], sum(weights_i))
            else:
                raise ValueError("Using client-specified weights requires client-specified size")
            blended[i] = self.build_generic_dataset(BlendedDataset, self.is_built_on_rank, True,
                                                    megatron_datasets[i], weights_i, size_i, self.config)
        return blended

    def _build_megatron_datasets_parallel(self, prefixes: List[str], split: List[Optional[tuple]],
                                          sizes_per_dataset: List[List[Optional[int]]]) -> List[List[Any]]:
        """Per split, the mid-level dataset of every prefix: built by the cache-building rank(s) first."""
        datasets: List[List[Any]] = [[] for _ in Split]

        def build_all() -> None:
            for prefix, sizes in zip(prefixes, sizes_per_dataset):
                for j, dataset in enumerate(self._build_megatron_dataset_splits(prefix, split, sizes, False)):
                    datasets[j].append(dataset)

        rank_zero_first(build_all, self.config.shared_storage)
        return datasets

    def _build_megatron_dataset_splits(self, dataset_path: Optional[str], split: List[Optional[tuple]],
                                       sizes: List[Optional[int]], synchronize_ranks: bool = True
                                       ) -> List[Optional[MegatronDataset]]:
        """Each split's mid-level dataset over one low-level dataset (None where the split is empty)."""
        if distributed() and not self.is_built_on_rank():
            for i in range(len(Split)):
                if split[i] is not None and synchronize_ranks:
                    barrier()
            return [None] * len(Split)
        low_level_dataset = self.cls.build_low_level_dataset(dataset_path, self.config)
        num_elements = self.cls.numel_low_level_dataset(low_level_dataset)
        datasets: List[Optional[MegatronDataset]] = []
        for i, split_name in enumerate(Split):
            if split[i] is None:
                datasets.append(None)
                continue
            begin = int(round(split[i][0] * float(num_elements)))
            end = int(round(split[i][1] * float(num_elements)))
            indices = numpy.arange(begin, end, dtype=numpy.int32)
            datasets.append(self.build_generic_dataset(self.cls, self.is_built_on_rank, synchronize_ranks,
                                                       low_level_dataset, dataset_path, indices, sizes[i],
                                                       split_name, self.config))
        return datasets

    @staticmethod
    def build_generic_dataset(cls: Callable, is_built_on_rank: Callable[[], bool], synchronize_ranks: bool,
                              *args: Any) -> Optional[Any]:
        """`cls(*args)`: on the cache-building rank(s) first, then (after a barrier when synchronising) on the
        others; None where `is_built_on_rank()` is False."""
        if not distributed():
            return cls(*args)
        config = next((a for a in args if isinstance(a, BlendedMegatronDatasetConfig)), None)
        shared_storage = True if config is None else config.shared_storage

        def build() -> Optional[Any]:
            if not is_built_on_rank():
                return None
            try:
                return cls(*args)
            except OSError as err:
                if not builds_caches_first(shared_storage):
                    raise  # the other ranks only read the caches
                from fsdp2_backend.usage_errors import UsageError

                raise UsageError(f"data.data_cache_path (--data-cache-path): writing the dataset index caches "
                                 f"failed ({err.strerror or err}: {err.filename or 'the cache folder'}) — set it "
                                 f"to a folder you can write to") from None

        return rank_zero_first(build, shared_storage, synchronize=synchronize_ranks)


def _get_size_per_split_per_dataset(normalized_weights: List[float], target_size_per_split: List[Optional[int]],
                                    surplus: float = 0.0) -> List[List[int]]:
    """Samples to request per dataset per split: ceil(ceil(size * weight) * (1 + surplus))."""
    assert numpy.isclose(sum(normalized_weights), 1.0)
    return [[int(math.ceil(math.ceil(size * weight) * (1 + surplus))) for size in target_size_per_split]
            for weight in normalized_weights]
