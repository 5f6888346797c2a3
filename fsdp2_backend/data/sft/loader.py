"""Finding and reading SFT datasets: `data.dataset` / `data.eval_dataset` → HF `datasets` of canonical examples.

A dataset is named in `dataset_dir/dataset_info.json` (LLaMA-Factory's registry: `file_name` relative to
dataset_dir, `formatting`, `columns`, `tags`, `num_samples`), given inline ({file_name, formatting, ...}, MindSpeed's
way), or given as a path. Names may be a list or one comma-separated string. Files: .json, .jsonl, .parquet,
.csv, .arrow, .txt, or a directory of files of one such type. Read with HF `datasets` (arrow-backed, memory-mapped,
multi-process `map`, streaming, mixing) rather than by hand.
Mixing several datasets: `concat`, or `interleave_under` / `interleave_over` (stop at the first / the last
exhausted dataset) with `interleave_probs`. `max_samples` truncates each dataset; a registry entry's
`num_samples` resamples it to that size (seeded).
"""
from __future__ import annotations

import gc
import json
import os
from typing import Any, List, Optional

from fsdp2_backend.data.sft.formats import FORMATS, DatasetAttr, convert_example, fields_read, likely_formats
from fsdp2_backend.usage_errors import UsageError

FILE_TYPES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow",
              ".txt": "text"}
INLINE_KEYS = ("file_name", "formatting", "columns", "tags", "split", "num_samples")


def _entry_attr(name: str, entry: dict, base_dir: str, field: str) -> DatasetAttr:
    unknown = [k for k in entry if k not in INLINE_KEYS + ("ranking", "load_from")]
    if not entry.get("file_name") or unknown:
        what = f"unknown keys {unknown}" if unknown else "no file_name"
        raise UsageError(f"data.{field}: dataset '{name}' has {what} — give a local file_name (hub downloads are not "
                         f"supported), with optional formatting, columns, tags, split, num_samples")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in FORMATS:
        raise UsageError(f"data.{field}: dataset '{name}' has formatting '{formatting}' — use one of "
                         f"{', '.join(FORMATS)}")
    path = entry["file_name"]
    if not os.path.isabs(path) and not os.path.exists(path):
        path = os.path.join(base_dir, path)
    return DatasetAttr(name=name, file_name=path, formatting=formatting, columns=dict(entry.get("columns") or {}),
                       tags=dict(entry.get("tags") or {}), split=entry.get("split", "train"),
                       num_samples=entry.get("num_samples"))


def dataset_attrs(spec: Any, dataset_dir: str, field: str = "dataset") -> List[DatasetAttr]:
    """The datasets `spec` names (see the module docstring), each checked to exist."""
    if spec is None:
        return []
    if isinstance(spec, dict):
        attrs = [_entry_attr(os.path.basename(str(spec.get("file_name", "inline"))), spec, dataset_dir, field)]
    else:
        names = spec if isinstance(spec, list) else [s.strip() for s in str(spec).split(",") if s.strip()]
        info_path = os.path.join(dataset_dir, "dataset_info.json")
        info = None
        attrs = []
        for name in names:
            if isinstance(name, dict):
                attrs.append(_entry_attr(os.path.basename(str(name.get("file_name"))), name, dataset_dir, field))
                continue
            if info is None and os.path.isfile(info_path):
                with open(info_path, encoding="utf-8") as f:
                    info = json.load(f)
            if info is not None and name in info:
                attrs.append(_entry_attr(name, info[name], dataset_dir, field))
            elif os.path.exists(name):
                attrs.append(DatasetAttr(name=os.path.basename(name.rstrip("/")), file_name=name))
            else:
                where = info_path if info is not None else f"{info_path} (missing)"
                raise UsageError(f"data.{field}: '{name}' is neither a dataset of {where} nor a file — register "
                                 f"it in dataset_info.json under data.dataset_dir, or give an inline "
                                 f"{{file_name: ..., formatting: ...}}")
    for attr in attrs:
        if not os.path.exists(attr.file_name):
            raise UsageError(f"data.{field}: {attr.file_name} (dataset '{attr.name}') not found — give an existing "
                             "file or directory")
    return attrs


def _data_files(path: str) -> tuple:
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if not f.startswith("."))
    else:
        files = [path]
    types = {FILE_TYPES.get(os.path.splitext(f)[1].lower()) for f in files}
    if len(types) != 1 or None in types:
        raise UsageError(f"data.dataset: {path} holds files of types {sorted(str(t) for t in types)} — give "
                         f"files of one type among {', '.join(FILE_TYPES)}")
    return types.pop(), files


def worker_processes(data_args) -> Optional[int]:
    """datasets' num_proc: None (this process) for 0 or 1 worker; 1 would still start a worker process."""
    workers = data_args.preprocessing_num_workers
    return workers if workers and workers > 1 else None


class CollectorPaused:
    """A batched map function run with Python's cycle collector paused (restored after each batch). A batch
    allocates tens of thousands of lists and dicts, none in a cycle (freed by their reference counts); each
    allocation burst set off collections that walked every object of the process (torch and transformers
    included: ~15% of the preprocessing time, and in datasets' forked workers each full collection also copied the
    parent's pages).

    `fresh_shards`: set when the map rebuilds its cache (overwrite_cache) with several workers. datasets takes the
    shard count of cache files an earlier run left under the same fingerprint, even when told not to load them: a
    rebuild with 2 workers after a run with 1 ran as one shard, in one worker (slower than no worker at all). The
    count is part of this object's hash, hence of the map's fingerprint, so such a rebuild has no earlier files and
    splits into `fresh_shards` shards."""

    def __init__(self, function, fresh_shards: Optional[int] = None):
        self.function = function
        self.fresh_shards = fresh_shards

    def __call__(self, batch):
        if not gc.isenabled():
            return self.function(batch)
        gc.disable()
        try:
            return self.function(batch)
        finally:
            gc.enable()


def batched_map(dataset, function, data_args, streaming: bool, desc: str, **kwargs):
    """`dataset.map(function)` in batches of preprocessing_batch_size, over preprocessing_num_workers processes,
    rebuilding datasets' cache with overwrite_cache (streaming: lazily, in this process)."""
    fresh_shards = None
    if not streaming:
        workers = worker_processes(data_args)
        kwargs.update(num_proc=workers, load_from_cache_file=not data_args.overwrite_cache, desc=desc)
        fresh_shards = workers if data_args.overwrite_cache else None
    return dataset.map(CollectorPaused(function, fresh_shards), batched=True,
                       batch_size=data_args.preprocessing_batch_size, **kwargs)


def _align(attr: DatasetAttr):
    """Batched map: raw rows → canonical columns (messages, system, tools); malformed rows dropped."""
    def align(batch):
        out = {"messages": [], "system": [], "tools": []}
        size = len(next(iter(batch.values()))) if batch else 0
        for i in range(size):
            example = convert_example({key: values[i] for key, values in batch.items()}, attr)
            if example is not None:
                for key in out:
                    out[key].append(example[key])
        return out
    return align


MOSTLY_MALFORMED = 0.5  # a dataset losing more than this share of its rows is read under the wrong format


def _empty(attr: DatasetAttr) -> UsageError:
    return UsageError(f"data.dataset: {attr.file_name} (dataset '{attr.name}') has no rows — give a file with "
                      f"{attr.formatting} rows, or remove it from the list")


def _check_rows(attr: DatasetAttr, total: int, kept: int, columns: List[str]) -> None:
    """Says the dropped rows once; refuses a dataset whose rows are mostly malformed (wrong `formatting` or
    `columns`): training on it would train empty turns, or nothing."""
    dropped = total - kept
    if not dropped:
        return
    if dropped > MOSTLY_MALFORMED * total:
        guess = next((f for f in likely_formats(columns) if f != attr.formatting), None)
        hint = (f"its columns look like {guess}: set formatting: {guess}" if guess
                else "fix its rows (unknown roles, roles out of turn, empty prompts or replies) or map its columns "
                     "in the entry's 'columns' (and 'tags')")
        raise UsageError(f"data.dataset: {attr.file_name} (dataset '{attr.name}'): {dropped} of {total} rows are "
                         f"not {attr.formatting} conversations — formatting {attr.formatting} reads "
                         f"{fields_read(attr)}, the file has columns {columns}; {hint} in dataset_info.json or the "
                         f"inline entry")
    from fsdp2_backend.distributed.console import print_rank0

    print_rank0(f"data.dataset {attr.name}: {dropped} of {total} rows dropped — not a valid {attr.formatting} "
                f"conversation (an unknown role, roles out of turn, an odd number of turns, or no text in the "
                f"prompt or the reply), as LLaMA-Factory drops them")


def _has_text(path: str) -> bool:
    """False for a file of zero bytes, or of whitespace only (datasets' json reader fails on one with
    StopIteration)."""
    if os.path.getsize(path) > 1 << 16:
        return True
    with open(path, "rb") as f:
        return bool(f.read().strip())


def load_one(attr: DatasetAttr, data_args, seed: int, streaming: bool):
    """One dataset as canonical examples (a Dataset, or an IterableDataset when streaming)."""
    from datasets import load_dataset

    builder, files = _data_files(attr.file_name)
    files = [f for f in files if _has_text(f)]
    if not files:
        raise _empty(attr)
    dataset = load_dataset(builder, data_files=files, split=attr.split, streaming=streaming)
    if not streaming and len(dataset) == 0:
        raise _empty(attr)
    if attr.num_samples and not streaming:
        import numpy as np

        rng = np.random.default_rng(seed)
        index = rng.permutation(len(dataset))[:attr.num_samples]
        if attr.num_samples > len(dataset):
            index = np.concatenate([index, rng.choice(len(dataset), attr.num_samples - len(dataset))])
        dataset = dataset.select(index.tolist())
    if data_args.max_samples and not streaming:
        dataset = dataset.select(range(min(len(dataset), data_args.max_samples)))
    columns = list(dataset.column_names or []) if not streaming else None
    if streaming:
        first = next(iter(dataset), None)
        if first is None:
            raise _empty(attr)
        columns = list(first.keys())
    converted = batched_map(dataset, _align(attr), data_args, streaming, f"Converting {attr.name}",
                            remove_columns=columns, features=_canonical_features())
    if not streaming:  # a streamed dataset's rows are not counted
        _check_rows(attr, len(dataset), len(converted), columns)
    return converted


def _canonical_features():
    """The canonical columns' arrow types, given so that datasets writes them without inferring the nested
    messages' types batch by batch (that inference cost as much as the conversion)."""
    from datasets import Features, List, Value

    return Features({"messages": List({"role": Value("string"), "content": Value("string")}),
                     "system": Value("string"), "tools": Value("string")})


def interleave_probs(data_args, count: int) -> Optional[List[float]]:
    if data_args.interleave_probs is None:
        return None
    probs = [float(p) for p in str(data_args.interleave_probs).split(",") if p.strip()]
    if len(probs) != count:
        raise UsageError(f"data.interleave_probs: {len(probs)} probabilities for {count} datasets — give one each")
    return probs


def merge(datasets: list, data_args, seed: int):
    """Several datasets → one, by `mix_strategy`."""
    from datasets import concatenate_datasets, interleave_datasets

    if len(datasets) == 1:
        return datasets[0]
    if data_args.mix_strategy == "concat":
        return concatenate_datasets(datasets)
    stopping = "first_exhausted" if data_args.mix_strategy == "interleave_under" else "all_exhausted"
    return interleave_datasets(datasets, probabilities=interleave_probs(data_args, len(datasets)), seed=seed,
                               stopping_strategy=stopping)
