"""`GPTDatasetConfig`, `GPTDataset`, `MockGPTDataset`: megatron-core 0.16.1's GPT pretraining dataset with the
same constructors, the same indices (hence the same samples in the same order) and the same sample dicts.

Facts reproduced (megatron-core gpt_dataset.py): epochs = the fewest whose tokens cover
`num_samples * seq_length + extra`; with more than one epoch the final epoch is shuffled separately when it
supplies fewer than 80% of an epoch's samples; each split owns one `RandomState(random_seed)` consumed by the
document index then the shuffle index; a sample is `seq_length + 1` tokens read across documents, padded with
the pad id; tokens/labels are the sample shifted by one; loss_mask zeroes EOD (eod_mask_loss) and padding;
position_ids restart after each EOD (reset_position_ids); pad ids become token 0.
Ours on purpose: `create_attention_mask` defaults to False (no S x S mask per sample unless asked), a split
with no tokens raises a UsageError (megatron-core loops forever there), and the extension field `shuffle`
(megatron-core has none; training.disable_shuffling / MindSpeed's --no-shuffle set it False): without shuffling
the document index is the split's documents in order, epoch after epoch, and the shuffle index is the identity,
so the samples read the documents sequentially. The default (True) is megatron-core's behaviour exactly.
Caches: megatron-core's names and descriptions (megatron_dataset.cached_arrays), so either side reuses the
other's; `shuffle`, `add_extra_token_to_sequence` and `drop_last_partial_validation_sequence` join the
description only when off their defaults (megatron-core leaves them out, so such caches never collide).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy
import torch

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data import index_building
from megatron_compat.data.dataset_config import BlendedMegatronDatasetConfig
from megatron_compat.data.megatron_dataset import MegatronDataset, cached_arrays
from megatron_compat.data.utils import Split

logger = logging.getLogger(__name__)

_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


@dataclass
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """megatron-core's GPT dataset fields plus our `shuffle`; see the module docstring for what differs."""

    reset_position_ids: Optional[bool] = None
    reset_attention_mask: Optional[bool] = None
    eod_mask_loss: Optional[bool] = None
    create_attention_mask: bool = False
    drop_last_partial_validation_sequence: bool = True
    add_extra_token_to_sequence: bool = True
    object_storage_cache_path: Optional[str] = None
    data_parallel_size: int = 1
    sequence_parallel_size: int = 0
    hybrid_context_parallel: bool = False
    sequences_per_dataset: Optional[Dict[str, int]] = None
    token_dtype_code: Optional[int] = field(init=False, default=None)
    context_parallel_size: Optional[int] = None
    shuffle: bool = True  # ours (not in megatron-core): False keeps documents and samples in order

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError("GPTDatasetConfig needs a tokenizer (its eod id marks document ends)")
        if None in (self.reset_position_ids, self.reset_attention_mask, self.eod_mask_loss):
            raise ValueError("reset_position_ids, reset_attention_mask and eod_mask_loss must be set")
        if self.object_storage_cache_path or self.sequences_per_dataset or self.hybrid_context_parallel:
            raise ValueError("object storage, sequences_per_dataset and hybrid_context_parallel are not supported")
        vocab_size = getattr(self.tokenizer, "vocab_size", None)
        self.token_dtype_code = None if vocab_size is None else (4 if vocab_size > 65536 else 8)


class GPTDataset(MegatronDataset):
    """Samples of `sequence_length` (+1) tokens drawn across the documents `indexed_indices` of an
    IndexedDataset, `num_samples` of them at least (one epoch when None)."""

    def __init__(self, indexed_dataset: Any, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self._causal_mask: Optional[torch.Tensor] = None
        self.document_index, self.sample_index, self.shuffle_index = self._build_document_sample_shuffle_indices()

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: Any) -> int:
        return low_level_dataset.sequence_lengths.shape[0]

    @staticmethod
    def build_low_level_dataset(dataset_path: str, config: GPTDatasetConfig) -> Any:
        from megatron_compat.data.indexed_dataset import IndexedDataset

        return IndexedDataset(dataset_path, multimodal=False, mmap=config.mmap_bin_files)

    @staticmethod
    def _extension_identifiers(config: GPTDatasetConfig) -> Dict[str, Any]:
        # Fields that change the indices but that megatron-core leaves out of (or lacks for) the cache key, only
        # when not at megatron-core's defaults: e.g. shuffled and unshuffled caches never collide, and a default
        # run's caches keep megatron-core's names.
        defaults = {"add_extra_token_to_sequence": True, "drop_last_partial_validation_sequence": True,
                    "shuffle": True}
        return {name: getattr(config, name) for name, default in defaults.items()
                if getattr(config, name) != default}

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: Optional[int]) -> Dict[str, torch.Tensor]:
        """tokens, labels, loss_mask, position_ids (and attention_mask when configured); idx None is a padding
        sample with a zero loss mask."""
        text = torch.from_numpy(self._query_document_sample_shuffle_indices(0 if idx is None else idx)[0])
        if self.config.add_extra_token_to_sequence:
            tokens, labels = text[:-1].contiguous(), text[1:].contiguous()
        else:
            tokens = text
            labels = torch.roll(text, shifts=-1, dims=0)
            labels[-1] = self._pad_token_id
        loss_mask, position_ids = get_loss_mask_and_position_ids(
            tokens, self.config.tokenizer.eod, self.config.reset_position_ids, self.config.eod_mask_loss)
        loss_mask[labels == self._pad_token_id] = 0.0
        tokens[tokens == self._pad_token_id] = 0
        labels[labels == self._pad_token_id] = 0
        if idx is None:
            loss_mask = torch.zeros_like(loss_mask)
        sample = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if self.config.create_attention_mask:
            sample = {"tokens": tokens, "labels": labels, "attention_mask": self._attention_mask(tokens),
                      "loss_mask": loss_mask, "position_ids": position_ids}
        return sample

    def _attention_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """(1, S, S) bool, True where attention is masked; cached when it does not depend on the tokens."""
        if not self.config.reset_attention_mask:
            if self._causal_mask is None:
                self._causal_mask = build_attention_mask(tokens, self.config.tokenizer.eod, False)
            return self._causal_mask
        return build_attention_mask(tokens, self.config.tokenizer.eod, True)

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        """The sample's token ids (int64, padded to seq_length + extra) and the ids of its documents."""
        extra = int(self.config.add_extra_token_to_sequence)
        idx = self.shuffle_index[idx]
        doc_beg, offset_beg = (int(v) for v in self.sample_index[idx])
        doc_end, offset_end = (int(v) for v in self.sample_index[idx + 1])
        document_ids = [int(d) for d in self.document_index[doc_beg:doc_end + 1]]
        if doc_beg == doc_end:
            parts = [self.dataset.get(document_ids[0], offset=offset_beg, length=offset_end - offset_beg + extra)]
        else:
            parts = [self.dataset.get(document_ids[0], offset=offset_beg)]
            parts += [self.dataset.get(d) for d in document_ids[1:-1]]
            parts.append(self.dataset.get(document_ids[-1], offset=0, length=offset_end + extra))
        text = numpy.concatenate(parts).astype(numpy.int64, copy=False)
        missing = self.config.sequence_length + extra - len(text)
        if missing > 0:  # the kept partial last sample of a validation split
            text = numpy.concatenate([text, numpy.full(missing, self._pad_token_id, dtype=numpy.int64)])
        return text, numpy.array(document_ids, dtype=numpy.int64)

    def _build_document_sample_shuffle_indices(self) -> Tuple[numpy.ndarray, numpy.ndarray, numpy.ndarray]:
        path_to_cache = self.config.path_to_cache
        if path_to_cache is None and not self.config.mock:
            path_to_cache = os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}"
        arrays = cached_arrays(path_to_cache, base, self.unique_description,
                               ["document_index", "sample_index", "shuffle_index"], self._build_indices,
                               self.config.shared_storage, f"{type(self).__name__} {self.index_split.name}")
        logger.info("> total number of samples: %d", arrays["sample_index"].shape[0] - 1)
        return arrays["document_index"], arrays["sample_index"], arrays["shuffle_index"]

    def _build_indices(self) -> Dict[str, numpy.ndarray]:
        seq_length = self.config.sequence_length
        extra = int(self.config.add_extra_token_to_sequence)
        tokens_per_epoch = self._get_num_tokens_per_epoch()
        if tokens_per_epoch <= extra and self.num_samples == 0:  # an empty split nobody samples from
            return {"document_index": numpy.zeros(0, dtype=numpy.int32),
                    "sample_index": numpy.zeros((1, 2), dtype=numpy.int32),
                    "shuffle_index": numpy.zeros(0, dtype=numpy.uint32)}
        if tokens_per_epoch <= extra:
            where = self.dataset_path or type(self.dataset).__name__
            raise UsageError(
                f"{where}: the {self.index_split.name} split has {len(self.indices)} documents and "
                f"{tokens_per_epoch} tokens, too few to draw {self.num_samples or 'any'} samples from — "
                f"give this split a larger share of --split (now {self.config.split}) or more data")
        num_epochs = self._get_num_epochs(tokens_per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            sans_final = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
            from_final = self.num_samples - sans_final
            per_epoch = (tokens_per_epoch - extra) // seq_length
            assert 0 <= from_final <= per_epoch + 1
            separate_final_epoch = from_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        # No RandomState at all without shuffling: the indices are then the documents and samples in order.
        random_state = numpy.random.RandomState(self.config.random_seed) if self.config.shuffle else None
        document_index = index_building.build_document_index(self.indices, num_epochs, random_state,
                                                             separate_final_epoch)
        drop_last = True
        if self.index_split == Split.valid:
            drop_last = self.config.drop_last_partial_validation_sequence
        sample_index = index_building.build_sample_index(
            numpy.asarray(self.dataset.sequence_lengths), document_index, seq_length, num_epochs,
            tokens_per_epoch, drop_last, self.config.add_extra_token_to_sequence)
        total = sample_index.shape[0] - 1
        shuffle_index = index_building.build_shuffle_index(sans_final if separate_final_epoch else total, total,
                                                           random_state)
        logger.info("> total number of epochs: %d", num_epochs)
        return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}

    def _get_num_tokens_per_epoch(self) -> int:
        return int(numpy.sum(self.dataset.sequence_lengths[self.indices]))

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        if self.num_samples is None:
            return 1
        wanted = self.num_samples * self.config.sequence_length + int(self.config.add_extra_token_to_sequence)
        return max(1, -(-wanted // num_tokens_per_epoch))


def get_loss_mask_and_position_ids(tokens: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                   eod_mask_loss: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """float loss mask (0 on EOD with eod_mask_loss) and position ids (restarting after each EOD when asked)."""
    seq_length = tokens.numel()
    loss_mask = torch.ones(seq_length, dtype=torch.float)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long)
    if reset_position_ids:
        position_ids -= _document_starts(tokens, eod_token)
    return loss_mask, position_ids


def build_attention_mask(tokens: torch.Tensor, eod_token: int, reset_attention_mask: bool) -> torch.Tensor:
    """Megatron's (1, S, S) boolean mask, True = masked: causal, and with reset_attention_mask no attention
    across an EOD into an earlier document."""
    seq_length = tokens.numel()
    allowed = torch.ones((seq_length, seq_length), dtype=torch.bool).tril_()
    if reset_attention_mask:
        starts = _document_starts(tokens, eod_token)
        allowed &= torch.arange(seq_length)[None, :] >= starts[:, None]
    return (~allowed).unsqueeze(0)


def _document_starts(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """Per position, where its document starts: one past the last EOD strictly before it (0 if none)."""
    seq_length = tokens.numel()
    marks = torch.zeros(seq_length, dtype=torch.long)
    eod = torch.nonzero(tokens[:-1] == eod_token).flatten() + 1
    marks[eod] = eod
    return torch.cummax(marks, dim=0).values


class MockGPTLowLevelDataset:
    """megatron-core's synthetic documents: 100000 of them, lengths from numpy's default_rng(0) in [1, 4096),
    document i = (1, 2, ..., len - 1) mod vocab followed by EOD."""

    seed: int = 0
    size: int = 100000
    max_sequence_length: int = 4096

    def __init__(self, tokenizer: Any) -> None:
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        rng = numpy.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length, size=self.size,
                                             dtype=numpy.int32)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> numpy.ndarray:
        length = int(self.sequence_lengths[idx])
        return numpy.concatenate([(numpy.arange(length - 1) + 1) % self.vocab_size,
                                  [self.eod_token]]).astype(numpy.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        return self[idx][offset:offset + length]


class MockGPTDataset(GPTDataset):
    """GPTDataset over MockGPTLowLevelDataset (config.mock must be True)."""

    def __init__(self, dataset: MockGPTLowLevelDataset, dataset_path: Optional[str], indices: numpy.ndarray,
                 num_samples: int, index_split: Split, config: GPTDatasetConfig) -> None:
        if not config.mock:
            raise ValueError("MockGPTDataset needs a config without blend (mock data)")
        super().__init__(dataset, dataset_path, indices, num_samples, index_split, config)

    @staticmethod
    def numel_low_level_dataset(low_level_dataset: MockGPTLowLevelDataset) -> int:
        return len(low_level_dataset)

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MockGPTLowLevelDataset:
        return MockGPTLowLevelDataset(config.tokenizer)
