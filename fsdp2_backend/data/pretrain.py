"""The pretraining data manager (`data_manager_type: mg`): from a Config to Megatron's train/valid/test
GPT datasets and their data loaders, sample for sample what Megatron-LM's pretrain_gpt.py would feed.

- Sample counts (Megatron's get_train_valid_test_num_samples): train = train_samples or
  train_iters x gbs; valid = (train_iters // eval_interval + 1) x eval_iters x gbs (0 without eval_interval);
  test = eval_iters x gbs.
- Data: `mock_data`; per-split `train/valid/test_data_path`; or `dataset`, a prefix or a Megatron blend
  "W1 P1 W2 P2" split by `split`. Any entry naming a raw .jsonl/.jsonl.gz/.parquet file is first tokenized
  (json key "text") into `tokenized_path` (default: a `<name>_tokenized` folder beside it) with the code of
  tools/preprocess_data.py, by global rank 0 when `data_shared_file_system`, else by each node's local rank 0;
  a complete earlier result is reused unless `overwrite_cache`; the other ranks wait and then check it.
- Index caches go to `data_cache_path`; `no_shared_storage` makes each node's local rank 0 build them.
- Loaders: Megatron's batch samplers (sampler.py) started at consumed_samples; `max_samples` truncates each
  dataset; `create_attention_mask_in_dataloader` adds the (1, S, S) mask; the seed's dataloader options apply.
- `disable_shuffling` (--no-shuffle): the datasets and the cyclic sampler keep their order (documents read in
  sequence); `dataloader_drop_last` decides whether validation/test keep their last incomplete group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, Subset

from fsdp2_backend.config.schema import dataset_entries
from fsdp2_backend.data.sampler import MegatronPretrainingRandomSampler, MegatronPretrainingSampler
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data.builder import BlendedMegatronDatasetBuilder
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron_compat.data.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from megatron_compat.data.token_range import check_token_ids
from megatron_compat.data.utils import get_blend_from_list, progress_lines, rank_zero_first

RAW_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


@dataclass
class PretrainData:
    """What the trainer iterates: one loader per split (None when the split is empty or not requested)."""

    train_loader: Optional[DataLoader]
    valid_loader: Optional[DataLoader]
    test_loader: Optional[DataLoader]
    datasets: Tuple[Any, Any, Any]
    sample_counts: Tuple[int, int, int]


def pretrain_sample_counts(train_iters: int, global_batch_size: int, train_samples: Optional[int] = None,
                           eval_interval: Optional[int] = None, eval_iters: int = 0) -> Tuple[int, int, int]:
    """(train, valid, test) samples requested from the datasets, as Megatron computes them."""
    train = train_samples if train_samples else train_iters * global_batch_size
    valid = (train_iters // eval_interval + 1) * eval_iters * global_batch_size if eval_interval else 0
    return train, valid, eval_iters * global_batch_size


def build_pretrain_data(config, tokenizer, dp_rank: int, dp_size: int, consumed_samples: int,
                        global_batch_size: int, micro_batch_size: int, train_iters: int,
                        consumed_valid_samples: int = 0) -> PretrainData:
    """Datasets and loaders for this data-parallel rank; call on every rank (ranks synchronise while caches
    and preprocessed files are built). `tokenizer` needs `eod` and `vocab_size` (megatron_compat's tokenizers;
    an HF tokenizer is adapted); raw inputs are tokenized with it. On resume pass Megatron's
    consumed_valid_samples = (iteration // eval_interval) x eval_iters x gbs unless it was saved."""
    data, training = config.data, config.training
    counts = pretrain_sample_counts(train_iters, global_batch_size, training.train_samples,
                                    training.eval_interval, training.eval_iters)
    with progress_lines(not data.no_shared_storage):  # Megatron's lines, once, from the building rank
        blend, blend_per_split = _blends(data, tokenizer)
        config_class, fim = GPTDatasetConfig, {}
        if data.fim_data:  # Megatron-LM's GPTFIMDataset (megatron_compat.data.fim_dataset)
            config_class, fim = GPTFIMDatasetConfig, dict(
                fim_rate=data.fim_rate, fim_spm_rate=data.fim_spm_rate, fim_extra_tokens=dict(data.fim_tokens),
                fim_split_sample=data.fim_split_sample, fim_fragment_rate=data.fim_fragment_rate,
                fim_no_prefix=data.fim_no_prefix)
        dataset_config = config_class(
            random_seed=training.seed, sequence_length=data.cutoff_len, blend=blend,
            blend_per_split=blend_per_split, split=None if blend_per_split else data.split,
            path_to_cache=data.data_cache_path, mmap_bin_files=data.mmap_bin_files,
            # reset_attention_mask: attention within each document (the seed: actual_seq_len from the EODs), the
            # positions running on in Megatron. Documents have one representation here, positions restarting at
            # each (kernels/varlen.py); with rotary (relative) positions a document's outputs do not depend on
            # where its positions start, so restarting them gives Megatron's result (absolute positions are
            # declined in validation: config/rules/run_inputs.py).
            tokenizer=dataset_tokenizer(tokenizer),
            reset_position_ids=bool(data.reset_position_ids or data.reset_attention_mask),
            reset_attention_mask=bool(data.reset_attention_mask), eod_mask_loss=data.eod_mask_loss,
            create_attention_mask=bool(data.create_attention_mask_in_dataloader),
            shared_storage=not data.no_shared_storage, shuffle=not training.disable_shuffling,
            mid_level_dataset_surplus=data.mid_level_dataset_surplus, **fim)
        cls = MockGPTDataset if dataset_config.mock else GPTFIMDataset if data.fim_data else GPTDataset
        datasets = BlendedMegatronDatasetBuilder(cls, list(counts), lambda: True, dataset_config).build()
    if data.max_samples:
        datasets = [None if d is None else Subset(d, range(min(len(d), data.max_samples))) for d in datasets]
    consumed = (consumed_samples, consumed_valid_samples, 0)
    # Megatron's training sampler always drops the last incomplete group (a partial global batch would break
    # the fixed gbs per iteration); dataloader_drop_last applies to the validation and test loaders.
    drop_last = (True, training.dataloader_drop_last, training.dataloader_drop_last)
    loaders = [_loader(d, c, micro_batch_size, dp_rank, dp_size, data.dataloader_type, training, drop)
               if d is not None and n > 0 and len(d) > 0 else None
               for d, c, n, drop in zip(datasets, consumed, counts, drop_last)]
    return PretrainData(*loaders, datasets=tuple(datasets), sample_counts=counts)


def data_iterator(loader: Optional[DataLoader], dataloader_type: str) -> Optional[Iterator]:
    """Megatron's iterator over a loader: once through for `single`, endlessly (epoch after epoch) for `cyclic`.
    Keep one per split for the whole run: Megatron's validation continues where the last evaluation stopped."""
    if loader is None:
        return None
    if dataloader_type == "cyclic":
        def cycle():
            while True:
                yield from loader
        return cycle()
    return iter(loader)


def _loader(dataset, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int, dataloader_type: str,
            training, drop_last: bool) -> DataLoader:
    if dataloader_type == "cyclic":  # Megatron's cyclic sampler has no partial batches to keep
        sampler = MegatronPretrainingRandomSampler(dataset, len(dataset), consumed, micro_batch_size, dp_rank,
                                                   dp_size, data_sharding=True,
                                                   shuffle=not training.disable_shuffling)
    else:
        if consumed >= len(dataset):
            raise UsageError(f"consumed samples: {consumed} already reach the dataset's {len(dataset)} samples — "
                             "train for fewer iterations or use dataloader_type cyclic")
        sampler = MegatronPretrainingSampler(len(dataset), consumed, micro_batch_size, dp_rank, dp_size,
                                             drop_last=drop_last)
    workers = training.dataloader_num_workers
    extra = {}
    if workers > 0:
        extra["persistent_workers"] = training.dataloader_persistent_workers
        if training.dataloader_prefetch_factor is not None:
            extra["prefetch_factor"] = training.dataloader_prefetch_factor
    # A generator of its own: starting an iterator draws a seed from it, not from the global RNG that dropout uses
    # (that draw came after a resumed run's RNG restore, so dropout masks differed from the straight run's).
    return DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                      pin_memory=training.dataloader_pin_memory and torch.cuda.is_available(),
                      generator=torch.Generator().manual_seed(training.seed), **extra)


def dataset_tokenizer(tokenizer):
    """The run's tokenizer (megatron_compat's surface: `eod`, `vocab_size`), which must mark document ends."""
    if getattr(tokenizer, "eod", None) is None:
        raise UsageError("tokenizer: it has no eos (or sep) token to mark document ends — use a tokenizer with "
                         "an eos token")
    return tokenizer


def _blends(data, tokenizer):
    """(blend, blend_per_split) from the data fields; raw files are tokenized first."""
    if data.mock_data:
        return None, None
    per_split = [data.train_data_path, data.valid_data_path, data.test_data_path]
    if any(per_split):  # validation refused per-split paths together with data.dataset
        return None, [None if p is None else _resolve(get_blend_from_list(list(p)), data, tokenizer)
                      for p in per_split]
    entries = dataset_entries(data.dataset)  # validation already normalised it; a hand-made config is read alike
    assert entries, "validation requires data.dataset in pretraining"
    return _resolve(get_blend_from_list(entries), data, tokenizer), None


def _resolve(blend, data, tokenizer):
    prefixes, weights = blend
    raw = [p for p in prefixes if p.endswith(RAW_SUFFIXES)]
    if raw:
        done = _preprocess(raw, data, tokenizer)
        prefixes = [done.get(p, p) for p in prefixes]
    missing = [p for p in prefixes if not (os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx"))]
    if missing:
        raise UsageError(f"dataset: {missing[0]}.bin/.idx not found — give the prefix of files written by "
                         "preprocess_data.py, or a raw .jsonl/.jsonl.gz/.parquet file")
    # ids beyond the tokenizer's vocabulary, found now rather than as an embedding IndexError; the building
    # rank scans (and caches the range beside the .idx), the others then read its cache
    rank_zero_first(lambda: [check_token_ids(p, tokenizer.vocab_size, data.data_cache_path) for p in prefixes],
                    not data.no_shared_storage)
    return prefixes, weights


def _tokenized_prefix(raw_path: str, tokenized_path: Optional[str]) -> str:
    name = os.path.basename(raw_path)
    for suffix in RAW_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    folder = tokenized_path or os.path.join(os.path.dirname(os.path.abspath(raw_path)), f"{name}_tokenized")
    return os.path.join(folder, name)


def _preprocess(raw_paths: Sequence[str], data, tokenizer) -> dict:
    """{raw path: indexed prefix}; tokenized on the preprocessing rank(s), checked everywhere."""
    from megatron_compat.data.preprocess import output_prefix_for, outputs_complete, preprocess_files

    targets = {p: output_prefix_for(_tokenized_prefix(p, data.tokenized_path), "text") for p in raw_paths}

    def tokenize() -> None:
        for raw, prefix in targets.items():
            if not os.path.isfile(raw):
                raise UsageError(f"dataset: {raw} not found — give an existing raw data file")
            if data.overwrite_cache or not outputs_complete([prefix]):
                preprocess_files(raw, _tokenized_prefix(raw, data.tokenized_path), ["text"], tokenizer,
                                 append_eod=bool(data.append_eod), workers=data.preprocessing_num_workers or 1,
                                 batch_docs=data.preprocessing_batch_size)

    # the others wait for the tokenized files, and stop if tokenizing failed
    rank_zero_first(tokenize, bool(data.data_shared_file_system) and not data.no_shared_storage, others=False)
    missing = [prefix for prefix in targets.values() if not outputs_complete([prefix])]
    if missing:
        raise UsageError(f"tokenized_path: {missing[0]}.bin/.idx not visible on this node after preprocessing — "
                         "unset data_shared_file_system when nodes do not share this folder")
    return targets
