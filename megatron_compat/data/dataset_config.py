"""`BlendedMegatronDatasetConfig`: megatron-core 0.16.1's dataset configuration with the same fields and
defaults, plus `shared_storage` (ours: whether `path_to_cache` is one folder seen by all nodes).

Facts reproduced: no blend and no per-split blend means mock data with split "1,1,1"; a blend needs a split;
per-split blends exclude `blend` and `split`; the split matrix is derived from the split string.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from megatron_compat.data.utils import Split, convert_split_vector_to_split_matrix, parse_and_normalize_split

logger = logging.getLogger(__name__)

Blend = Tuple[List[str], Optional[List[float]]]


@dataclass
class BlendedMegatronDatasetConfig:
    """Configuration for the Megatron dataset stack (see megatron-core for each field's meaning)."""

    random_seed: int
    sequence_length: int
    blend: Optional[Blend] = None
    blend_per_split: Optional[List[Optional[Blend]]] = None
    multiple_validation_sets: Optional[bool] = None
    full_validation: Optional[bool] = None
    split: Optional[str] = None
    split_matrix: Optional[List[Optional[Tuple[float, float]]]] = field(init=False, default=None)
    num_dataset_builder_threads: int = 1
    path_to_cache: Optional[str] = None
    mmap_bin_files: bool = True
    mock: bool = field(init=False, default=False)
    tokenizer: Optional[Any] = None
    mid_level_dataset_surplus: float = 0.005
    allow_ambiguous_pad_tokens: Optional[bool] = False
    fast_cache_load: bool = False
    defer_npy_index_mmap: bool = False
    shared_storage: bool = True
    """Ours: False when nodes do not share `path_to_cache`; each node's local rank 0 then builds the caches."""

    def __post_init__(self) -> None:
        if self.fast_cache_load or self.defer_npy_index_mmap:
            raise ValueError("fast_cache_load / defer_npy_index_mmap are not supported: caches are always checked "
                             "and memory-mapped when loaded")
        if self.blend_per_split is not None and any(self.blend_per_split):
            if self.blend is not None or self.split is not None:
                raise ValueError("blend_per_split excludes blend and split")
            if len(self.blend_per_split) != len(Split):
                raise ValueError(f"blend_per_split must hold {len(Split)} blends (train, valid, test)")
            for blend in self.blend_per_split:
                _check_blend(blend)
            return
        if self.blend is not None:
            _check_blend(self.blend)
            if self.split is None:
                raise ValueError("split must be provided when blend is not None")
        else:
            self.mock = True
            self.split = "1,1,1"
            logger.info("Let mock = True, as both blend and blend_per_split are None")
        self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))


def _check_blend(blend: Optional[Blend]) -> None:
    if blend is not None and blend[1] is not None and len(blend[0]) != len(blend[1]):
        raise ValueError("blend prefixes and weights must be equal in number")
