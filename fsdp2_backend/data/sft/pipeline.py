"""The SFT data manager (`data_manager_type: lf`, `stage: sft`): Config → training and evaluation data.

    load (loader.py) → mix → split off val_size → encode + pack (supervised.py, `datasets.map` with
    preprocessing_num_workers / preprocessing_batch_size) → [tokenized_path] → loaders (collator.py)

- Preparation runs on the preparing rank first (global rank 0 with `data_shared_file_system`, else each node's
  local rank 0; `no_shared_storage` forces the latter), then on the others, which find its results: the
  `tokenized_path` folder (arrow files written by `datasets.save_to_disk` — never pickle; loaded when present
  unless `overwrite_cache`, which rebuilds it), or datasets' own map cache.
- Training order: one permutation per epoch (seed = epoch; identity with `disable_shuffling`) dealt round-robin
  to data-parallel ranks, started at the consumed samples (the pretraining cyclic sampler) — so a global batch
  holds the same samples at any data-parallel size. Streaming: an iterable pipeline (shuffle buffer of
  `buffer_size`, split by rank), endless over epochs; its length is unknown, so training needs max_steps.
- Evaluation sets: `val_size` split off the training data (seeded; per dataset with `eval_on_each_dataset`),
  or `eval_dataset`; one set per dataset with `eval_on_each_dataset`, else one merged set.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader

from fsdp2_backend.data.sampler import MegatronPretrainingRandomSampler
from fsdp2_backend.data.sft.collator import SFTCollator
from fsdp2_backend.data.sft.loader import batched_map, dataset_attrs, load_one, merge
from fsdp2_backend.data.sft.supervised import IGNORE_INDEX, SupervisedProcessor
from fsdp2_backend.data.sft.template import get_template
from megatron_compat.data.utils import global_rank, rank_zero_first
from fsdp2_backend.usage_errors import UsageError

COLUMNS = ["input_ids", "labels", "doc_lens"]
SET_NAMES = "sft_sets.json"  # in tokenized_path: the saved sets' names, written last (its presence = complete)


@dataclass
class SFTData:
    train_batches: Iterator
    train_samples: Optional[int]              # rows per epoch (None when streaming)
    eval_sets: Dict[str, object] = field(default_factory=dict)
    collator: Optional[Callable] = None


def _split_val(dataset, val_size: float, seed: int):
    size = int(val_size) if val_size >= 1 else val_size
    parts = dataset.train_test_split(test_size=size, seed=seed)
    return parts["train"], parts["test"]


def _process(dataset, processor, data_args, streaming: bool, what: str):
    return batched_map(dataset, processor, data_args, streaming, f"Encoding {what}",
                       remove_columns=["messages", "system", "tools"], features=_encoded_features())


def _encoded_features():
    """The encoded columns' arrow types (the ones datasets infers: int32 ids), given so that it does not scan every
    id of every batch to infer them (a third of the encoding map's time)."""
    from datasets import Features, List, Value

    return Features({"input_ids": List(Value("int32")), "labels": List(Value("int64")),
                     "doc_lens": List(Value("int64"))})


def prepare_datasets(config, hf_tokenizer):
    """{"train": dataset, "eval:<name>": dataset, ...} encoded (and packed); runs where it is called."""
    data, seed = config.data, config.training.seed
    streaming = bool(data.streaming)
    template = get_template(data, hf_tokenizer)
    processor = SupervisedProcessor(template, hf_tokenizer, data, packing=bool(data.packing))
    train_attrs = dataset_attrs(data.dataset, data.dataset_dir, "dataset")
    raw = [load_one(a, data, seed, streaming) for a in train_attrs]
    evals: Dict[str, object] = {}
    if data.val_size:
        if streaming:
            merged = merge(raw, data, seed)
            evals["eval"], raw = merged.take(int(data.val_size)), [merged.skip(int(data.val_size))]
        elif data.eval_on_each_dataset:
            split = [_split_val(d, data.val_size, seed) for d in raw]
            raw = [train for train, _ in split]
            evals = {attr.name: val for attr, (_, val) in zip(train_attrs, split)}
        else:
            train, evals["eval"] = _split_val(merge(raw, data, seed), data.val_size, seed)
            raw = [train]
    elif data.eval_dataset is not None:
        eval_attrs = dataset_attrs(data.eval_dataset, data.dataset_dir, "eval_dataset")
        loaded = [load_one(a, data, seed, False) for a in eval_attrs]
        evals = ({a.name: d for a, d in zip(eval_attrs, loaded)} if data.eval_on_each_dataset
                 else {"eval": merge(loaded, data, seed)})
    train = merge(raw, data, seed)
    if streaming and not config.training.disable_shuffling:
        train = train.shuffle(seed=seed, buffer_size=data.buffer_size)
    out = {"train": _process(train, processor, data, streaming, "train")}
    if not streaming and len(out["train"]) == 0:
        raise UsageError(f"data.dataset: no training row is left after encoding (each has nothing to train within "
                         f"cutoff_len {data.cutoff_len}) — raise data.cutoff_len or check the replies")
    for name, dataset in evals.items():
        out[f"eval:{name}"] = _process(dataset, processor, data, streaming and name == "eval", f"eval {name}")
    return out


def _load_or_build(config, hf_tokenizer):
    """The encoded datasets, through `tokenized_path` when set (see the module docstring)."""
    from datasets import DatasetDict, load_from_disk

    data = config.data
    path = data.tokenized_path
    shared = bool(data.data_shared_file_system) and not data.no_shared_storage
    if global_rank() != 0:  # one set of progress bars per job
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    if not path or data.streaming:
        return rank_zero_first(lambda: prepare_datasets(config, hf_tokenizer), shared)

    def build():
        if data.overwrite_cache or not os.path.isfile(os.path.join(path, SET_NAMES)):
            if os.path.isfile(os.path.join(path, SET_NAMES)):
                os.remove(os.path.join(path, SET_NAMES))  # incomplete until the rebuild is saved
            prepared = prepare_datasets(config, hf_tokenizer)
            names = list(prepared)  # split names must be plain words: set i is saved as split_i
            DatasetDict({f"split_{i}": prepared[n] for i, n in enumerate(names)}).save_to_disk(path)
            with open(os.path.join(path, SET_NAMES), "w", encoding="utf-8") as f:
                json.dump(names, f)
    rank_zero_first(build, shared, others=False)
    if not os.path.isfile(os.path.join(path, SET_NAMES)):
        raise UsageError(f"data.tokenized_path: {path} is not visible on this node after preprocessing — unset "
                         "data_shared_file_system when nodes do not share this folder")
    with open(os.path.join(path, SET_NAMES), encoding="utf-8") as f:
        names = json.load(f)
    loaded = load_from_disk(path)
    return {n: loaded[f"split_{i}"] for i, n in enumerate(names)}


def pad_multiple(parallel) -> int:
    cp = parallel.cp_size
    return 1 if cp <= 1 else (2 * cp if parallel.cp_type == "ring" else cp)


def _collator(config, hf_tokenizer) -> SFTCollator:
    pad = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else hf_tokenizer.eos_token_id
    return SFTCollator(pad_id=pad or 0, neat_packing=bool(config.data.neat_packing),
                       ignore_pad_token_for_loss=config.data.ignore_pad_token_for_loss,
                       pad_multiple=pad_multiple(config.parallel))


def _loader_kwargs(training) -> dict:
    workers = training.dataloader_num_workers
    extra = {"num_workers": workers, "pin_memory": training.dataloader_pin_memory and torch.cuda.is_available()}
    if workers > 0:
        extra["persistent_workers"] = training.dataloader_persistent_workers
        if training.dataloader_prefetch_factor is not None:
            extra["prefetch_factor"] = training.dataloader_prefetch_factor
    return extra


def _endless(loader: DataLoader, on_epoch: Optional[Callable[[int], None]] = None,
             first: Optional[DataLoader] = None) -> Iterator:
    """Epoch after epoch over `loader` (`first` instead for the first pass: a resumed stream's remainder)."""
    epoch = 0
    while True:
        if on_epoch is not None:
            on_epoch(epoch)
        yielded = False
        for batch in (first if epoch == 0 and first is not None else loader):
            yielded = True
            yield batch
        if not yielded and not (epoch == 0 and first is not None):  # a resumed stream may start past its end
            raise UsageError("data.dataset: this rank received no training sample — use more data or fewer ranks")
        epoch += 1


def build_sft_data(config, tokenizer, dp_rank: int, dp_size: int, consumed_samples: int,
                   prepared: Optional[dict] = None) -> SFTData:
    """Training batches for this data-parallel rank (endless, from `consumed_samples`) and the evaluation sets.
    `prepared`: a dict kept by the caller, filled on the first call and reused (preparation runs once)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise UsageError("model.tokenizer_type: the SFT data path needs an HF tokenizer (chat templates) — unset "
                         "tokenizer_type and give tokenizer_name_or_path")
    training, mbs = config.training, config.training.per_device_train_batch_size
    if prepared is None:
        prepared = {}
    if not prepared:
        prepared.update(_load_or_build(config, hf))
    collator = _collator(config, hf)
    train = prepared["train"].with_format(None, columns=COLUMNS) if not config.data.streaming else prepared["train"]
    evals = {k.split(":", 1)[1]: v for k, v in prepared.items() if k.startswith("eval:")}
    if config.data.streaming:
        from datasets.distributed import split_dataset_by_node

        stream = split_dataset_by_node(train, rank=dp_rank, world_size=dp_size)
        loader = DataLoader(stream, batch_size=mbs, collate_fn=collator, **_loader_kwargs(training))
        first = None
        if consumed_samples:  # a resumed run continues the stream where it stopped (within its first pass)
            first = DataLoader(stream.skip(consumed_samples // dp_size), batch_size=mbs, collate_fn=collator,
                               **_loader_kwargs(training))
        return SFTData(_endless(loader, getattr(stream, "set_epoch", None), first), None, evals, collator)
    if len(train) < mbs * dp_size:
        raise UsageError(f"data.dataset: {len(train)} training rows cannot fill one micro-batch on each of "
                         f"{dp_size} data-parallel ranks — use more data, or a smaller batch")
    loader = DataLoader(train, batch_sampler=_train_sampler(train, config, consumed_samples, dp_rank, dp_size),
                        collate_fn=collator, **_loader_kwargs(training))
    return SFTData(_endless(loader), len(train), evals, collator)


def _train_sampler(train, config, consumed_samples: int, dp_rank: int, dp_size: int):
    return MegatronPretrainingRandomSampler(train, len(train), consumed_samples,
                                            config.training.per_device_train_batch_size, dp_rank, dp_size,
                                            data_sharding=False, shuffle=not config.training.disable_shuffling)


def training_rows(config, hf_tokenizer) -> Iterator[dict]:
    """The encoded training rows in the order training consumes them (one data-parallel rank, from the start; a
    larger data-parallel size deals the same order out round-robin): the same preparation (tokenized_path
    included) and sampler as build_sft_data. tools/preview_data.py prints these."""
    train = _load_or_build(config, hf_tokenizer)["train"]
    if config.data.streaming:
        yield from train
        return
    train = train.with_format(None, columns=COLUMNS)
    mbs = config.training.per_device_train_batch_size
    if len(train) < mbs:
        raise UsageError(f"data.dataset: {len(train)} training rows cannot fill one micro-batch of {mbs}")
    for batch in _train_sampler(train, config, 0, 0, 1):
        for index in batch:
            yield train[index]


class EvalRows(torch.utils.data.Dataset):
    """This rank's share of an evaluation set, padded so every rank runs the same number of micro-batches
    (the model's collectives need it): a padding row repeats row 0 with nothing trained."""

    def __init__(self, dataset, dp_rank: int, dp_size: int, mbs: int):
        self.dataset = dataset
        step = mbs * dp_size
        total = -(-len(dataset) // step) * step
        self.index = list(range(dp_rank, total, dp_size))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        j = self.index[i]
        if j < len(self.dataset):
            return self.dataset[j]
        row = dict(self.dataset[0])
        return {**row, "labels": [IGNORE_INDEX] * len(row["labels"])}


def eval_loaders(data: SFTData, config, dp_rank: int, dp_size: int) -> Dict[str, List]:
    """{set name: this rank's micro-batches} (streaming sets are read to their end on each rank's share)."""
    mbs = config.training.per_device_train_batch_size
    out = {}
    for name, dataset in data.eval_sets.items():
        if not hasattr(dataset, "__len__"):
            from datasets import Dataset

            dataset = Dataset.from_list(list(dataset))
        rows = EvalRows(dataset.with_format(None, columns=COLUMNS), dp_rank, dp_size, mbs)
        out[name] = DataLoader(rows, batch_size=mbs, collate_fn=data.collator)
    return out
