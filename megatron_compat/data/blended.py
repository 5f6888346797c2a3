"""`BlendedDataset`: megatron-core 0.16.1's blend of several mid-level datasets, same constructor, same
dataset/sample index (hence the same samples in the same order), cached like GPTDataset's indices.

Facts reproduced: with a size the weights are normalised and `size` greedy picks are made; without one, the
integer weights are sample counts taken exhaustively; a blend that asks a dataset for more samples than it has
raises IndexError pointing at `mid_level_dataset_surplus`; items are the dataset's dict plus `dataset_id`.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy
import torch

from megatron_compat.data import index_building
from megatron_compat.data.dataset_config import BlendedMegatronDatasetConfig
from megatron_compat.data.megatron_dataset import MegatronDataset, cached_arrays, describe, md5
from megatron_compat.data.utils import normalize

logger = logging.getLogger(__name__)


class BlendedDataset(torch.utils.data.Dataset):
    """Draws from `datasets` in proportion to `weights`, `size` samples (exhaustively when None)."""

    def __init__(self, datasets: List[MegatronDataset], weights: List[Union[int, float]], size: Optional[int],
                 config: BlendedMegatronDatasetConfig) -> None:
        if len(datasets) != len(weights) or not 0 < len(datasets) < 32767:
            raise ValueError("BlendedDataset needs as many weights as datasets (fewer than 32767)")
        if any(type(d) is not type(datasets[0]) or d.index_split != datasets[0].index_split for d in datasets):
            raise ValueError("blended datasets must share one class and one split")
        if not all(w > 0 for w in weights) or any(type(w) is not type(weights[0]) for w in weights):
            raise ValueError(f"blend weights must be positive and of one type, got {weights}")
        if size is None and isinstance(weights[0], float) and any(w != int(w) for w in weights):
            raise ValueError("an exhaustive blend (size None) needs whole-number weights")
        if len(datasets) == 1:
            logger.warning("Building a BlendedDataset for a single MegatronDataset")
        if size is not None:
            weights = normalize(weights)
        self.datasets = datasets
        self.split = datasets[0].index_split
        self.weights = weights
        self.size = size
        self.config = config

        unique_identifiers = OrderedDict()
        unique_identifiers["class"] = type(self).__name__
        unique_identifiers["datasets"] = [d.unique_identifiers for d in datasets]
        unique_identifiers["split"] = self.split.name
        unique_identifiers["weights"] = self.weights
        unique_identifiers["size"] = self.size
        self.unique_description = describe(unique_identifiers)
        self.unique_description_hash = md5(self.unique_description)
        self.dataset_index, self.dataset_sample_index = self._build_indices()

    def __len__(self) -> int:
        return self.dataset_index.shape[0]

    def __getitem__(self, idx: int) -> Dict[str, Any]:
        dataset_id = self.dataset_index[idx]
        return {"dataset_id": dataset_id, **self.datasets[dataset_id][int(self.dataset_sample_index[idx])]}

    def _build_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray]:
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.split.name}"
        arrays = cached_arrays(self.config.path_to_cache, base, self.unique_description,
                               ["dataset_index", "dataset_sample_index"], self._build, self.config.shared_storage,
                               type(self).__name__)
        return arrays["dataset_index"], arrays["dataset_sample_index"]

    def _build(self) -> Dict[str, numpy.ndarray]:
        logger.info("\tBuild and save the dataset and dataset sample indexes")
        if self.size is not None:
            dataset_index, sample_index = index_building.build_blending_indices(self.weights, self.size)
        else:
            dataset_index, sample_index = index_building.build_exhaustive_blending_indices(self.weights)
        ids, counts = numpy.unique(dataset_index, return_counts=True)
        for i, (dataset_id, count) in enumerate(zip(ids, counts)):
            if len(self.datasets[dataset_id]) < count:
                raise IndexError(
                    f"The {self.split.name} blend oversamples the contributing datasets and, for example, "
                    f"requests {count} samples from {type(self.datasets[dataset_id]).__name__} number {i} in "
                    f"excess of its size {len(self.datasets[dataset_id])}. Increase mid_level_dataset_surplus, "
                    f"e.g. two- or ten-fold, from its current value ({self.config.mid_level_dataset_surplus}).")
        return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}
