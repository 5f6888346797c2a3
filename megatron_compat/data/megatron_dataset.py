"""`MegatronDataset` (the base of GPTDataset, with megatron-core's constructor), the pad-token rule, and the
on-disk cache of index arrays shared by GPTDataset and BlendedDataset.

Cache protocol (megatron-core 0.16.1's file names and descriptions, so each side reads the other's caches):
arrays live as `<md5 of the description>-<Class>-<split>-<name>.npy` next to a `...-description.txt`, in
`path_to_cache`; the description is `json.dumps(unique_identifiers, indent=4)` with objects (datasets,
tokenizers) described by their own `unique_identifiers`. The rank chosen by `builds_caches_first` builds and
saves them; the builder puts a barrier between it and the other ranks, which then only load. Files are written
under temporary names and renamed, so a reader never sees a half-written array. Building and loading log
megatron-core's INFO lines ("Build and save the GPTDataset train indices", the time elapsed, ...).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional

import numpy
import torch

from fsdp2_backend.checkpoint.atomic import write_atomically
from megatron_compat.data.dataset_config import BlendedMegatronDatasetConfig
from megatron_compat.data.utils import Split, builds_caches_first, global_rank

_PAD_TOKEN_ID = -1

logger = logging.getLogger(__name__)


def describe(identifiers: Dict[str, Any]) -> str:
    """The JSON description whose md5 names a cache; objects describe themselves by `unique_identifiers`."""
    def default(obj):
        ids = getattr(obj, "unique_identifiers", None)
        if ids is not None:
            return ids
        return {"class": type(obj).__name__, "vocab_size": getattr(obj, "vocab_size", None),
                "name_or_path": getattr(obj, "name_or_path", None)}
    return json.dumps(identifiers, indent=4, default=default)


def md5(text: str) -> str:
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest()


def cached_arrays(path_to_cache: Optional[str], base: str, description: str, names: List[str],
                  build: Callable[[], Dict[str, numpy.ndarray]], shared_storage: bool, what: str
                  ) -> Dict[str, numpy.ndarray]:
    """Loads the named arrays from the cache (memory-mapped), or builds them (and saves them when there is a
    cache folder and this rank is the builder). `what` ("GPTDataset train", "BlendedDataset") names them in
    megatron-core's progress lines ("Build and save the GPTDataset train indices", ...), logged at INFO."""
    path_of = {name: os.path.join(path_to_cache, f"{base}-{name}.npy") for name in names} if path_to_cache else {}
    description_path = os.path.join(path_to_cache, f"{base}-description.txt") if path_to_cache else None
    if path_to_cache and all(os.path.isfile(p) for p in [description_path, *path_of.values()]):
        logger.info("Load the %s indices", what)
        arrays = {}
        for name, path in path_of.items():
            logger.info("\tLoad the %s from %s", name.replace("_", " "), os.path.basename(path))
            arrays[name] = numpy.load(path, mmap_mode="r", allow_pickle=False)  # a foreign cache holds no objects
        return arrays
    if path_to_cache and not builds_caches_first(shared_storage):
        raise FileNotFoundError(
            f"{description_path}: index cache missing on rank {global_rank()} after the building rank wrote it — "
            f"is path_to_cache ({path_to_cache}) shared by all nodes? If not, set no_shared_storage "
            f"(each node's local rank 0 then builds its own copy)")
    logger.info("Build and save the %s indices", what)
    started = time.time()
    arrays = build()
    if path_to_cache:
        os.makedirs(path_to_cache, exist_ok=True)
        for name, array in arrays.items():
            write_atomically(path_of[name], lambda f, a=array: numpy.save(f, a, allow_pickle=True))
        write_atomically(description_path, description)
    logger.info("\t> time elapsed: %4f seconds", time.time() - started)
    return arrays


def pad_token_id(config: BlendedMegatronDatasetConfig) -> int:
    """The tokenizer's pad id, or -1 when it has none or it collides with another special token (megatron-core's
    rule, which then never masks real tokens as padding unless `allow_ambiguous_pad_tokens`)."""
    tokenizer = config.tokenizer
    try:
        pad = tokenizer.pad
    except Exception:
        return _PAD_TOKEN_ID
    if pad is None:  # no pad token: nothing in the data is padding
        return _PAD_TOKEN_ID
    try:
        specials = [v for k, v in tokenizer.special_tokens_dict.items() if k != "pad_token"]
    except (AttributeError, IndexError, ValueError):
        specials = []
    if not specials:
        for name in ("eos", "eod"):
            try:
                specials.append(getattr(tokenizer, name))
            except (AttributeError, NotImplementedError):
                pass
    if pad in specials:
        if config.allow_ambiguous_pad_tokens:
            warnings.warn("The pad token id collides with another special token id; pad tokens in the data will "
                          "be masked out of the loss (allow_ambiguous_pad_tokens).")
            return pad
        warnings.warn("The pad token id collides with another special token id; tokens in the data are never "
                      "treated as padding.")
        return _PAD_TOKEN_ID
    return pad


class MegatronDataset(ABC, torch.utils.data.Dataset):
    """A split of a low-level dataset, with the identifiers that name its caches."""

    def __init__(self, dataset: Any, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: BlendedMegatronDatasetConfig) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.indices = indices
        self.num_samples = num_samples
        self.index_split = index_split
        self.config = config
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = type(self).__name__
        self.unique_identifiers["dataset_path"] = dataset_path
        self.unique_identifiers["num_samples"] = num_samples
        self.unique_identifiers["index_split"] = index_split.name
        for attr in self._key_config_attributes():
            self.unique_identifiers[attr] = getattr(config, attr)
        self.unique_identifiers.update(self._extension_identifiers(config))
        self.unique_description = describe(self.unique_identifiers)
        self.unique_description_hash = md5(self.unique_description)
        self._pad_token_id = pad_token_id(config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        raise NotImplementedError

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: BlendedMegatronDatasetConfig) -> Any:
        raise NotImplementedError

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return ["random_seed", "sequence_length", "split", "split_matrix", "tokenizer"]

    @staticmethod
    def _extension_identifiers(config: BlendedMegatronDatasetConfig) -> Dict[str, Any]:
        """Ours: settings megatron-core leaves out of the description although they change the indices, added
        only when they differ from megatron-core's behaviour, so that default caches keep megatron-core's names."""
        return {}

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __getitem__(self, idx: int) -> Dict[str, Any]: ...
