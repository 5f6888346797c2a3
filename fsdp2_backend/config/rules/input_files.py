"""The run's input files, checked with the rest of the config: before any process group, model or tokenizer is
loaded (a wrong data prefix used to be found only after the model had loaded; a missing model directory became
a Hugging Face hub message after seconds of imports).

`input_file_errors(config)` returns one message per problem, all at once:
- the model directory (`model.model_name_or_path`, Megatron `--load`) and the tokenizer directory, when given as
  a path that does not exist; the files Megatron's tokenizer type needs (GPT2BPETokenizer: --vocab-file and
  --merge-file; SentencePiece and TikTokenizer: --tokenizer-model), missing or not there;
- the pretraining data (`data.dataset`, Megatron `--data-path`, and the per-split paths): an odd number of blend
  entries, a weight of 0 or below (Megatron's rule), a `.bin` / `.idx` file named instead of its prefix, a prefix
  with no `.bin` / `.idx` pair (with "did you mean" among the prefixes beside it), a pair that does not open (a
  truncated `.idx` or `.bin`: IndexedDataset's own checks), a raw file that does not exist;
- the folders the data stack writes into: the dataset index caches (`<prefix>/cache/GPTDataset_indices` unless
  `data.data_cache_path`) and the tokenized copy of a raw file (`<name>_tokenized/` unless `data.tokenized_path`),
  which must be creatable — a read-only data folder is named with the field that moves the writes elsewhere.
Torch-free, like all of `config/`.
"""
from __future__ import annotations

import difflib
import os
from typing import List, Optional

from fsdp2_backend.config.schema import Config
from fsdp2_backend.usage_errors import UsageError

# raw files the pretraining data tokenizes first (data/pretrain.py RAW_SUFFIXES; config/ imports no torch)
RAW_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
INDEX_CACHE_DIR = os.path.join("cache", "GPTDataset_indices")  # megatron-core's default, under the prefix

_DATA_FIELDS = (("dataset", "--data-path"), ("train_data_path", "--train-data-path"),
                ("valid_data_path", "--valid-data-path"), ("test_data_path", "--test-data-path"))


def input_file_errors(config: Config) -> List[str]:
    errors = _model_errors(config)
    d = config.data
    if d.data_manager_type != "mg" or d.mock_data:
        return errors
    from fsdp2_backend.config.validation import dataset_entries

    for name, flag in _DATA_FIELDS:
        entries = dataset_entries(getattr(d, name))
        if entries:
            errors += _data_errors(f"data.{name} ({flag})", entries, config)
    return list(dict.fromkeys(errors))  # a read-only folder holding several prefixes: said once


def _looks_like_path(value: str) -> bool:
    """A local path rather than a hub id ("namespace/name"): absolute, relative with ./ or ~, or deeper."""
    return os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1 or os.sep != "/"


def _model_errors(config: Config) -> List[str]:
    m, errors = config.model, []
    for field, what, value in (("model_name_or_path", "model", m.model_name_or_path),
                               ("tokenizer_name_or_path", "tokenizer", m.tokenizer_name_or_path)):
        # no flag named here: the launcher names the one the user typed (--load, --tokenizer-model, ...)
        if value and _looks_like_path(str(value)) and not os.path.exists(os.path.expanduser(str(value))):
            errors.append(f"model.{field}: {value} not found{_did_you_mean_dir(str(value))} — give an existing "
                          f"local Hugging Face {what} directory (config.json, tokenizer files"
                          f"{', safetensors' if what == 'model' else ''}){' or a checkpoint' if what == 'model' else ''}")
    return errors + _tokenizer_file_errors(config)


def _tokenizer_file_errors(config: Config) -> List[str]:
    """Megatron's tokenizer types and the files each reads (megatron_compat.data.tokenizer.build_tokenizer)."""
    from megatron_compat.data.tokenizer import SENTENCEPIECE_TYPES

    m = config.model
    kind = m.tokenizer_type
    if kind == "GPT2BPETokenizer":
        needed = (("vocab_file", "--vocab-file"), ("merge_file", "--merge-file"))
    elif kind in SENTENCEPIECE_TYPES or kind == "TikTokenizer":
        needed = (("tokenizer_model", "--tokenizer-model"),)
    else:
        return []
    errors = []
    for field, flag in needed:
        value = getattr(m, field)
        if not value:
            errors.append(f"{flag}: required by --tokenizer-type {kind} (model.{field}) — give the path")
        elif not os.path.isfile(os.path.expanduser(str(value))):
            errors.append(f"{flag}: {value} not found (model.{field}, read by --tokenizer-type {kind}) — check "
                          f"the path")
    return errors


def _data_errors(what: str, entries: List[str], config: Config) -> List[str]:
    if len(entries) > 1 and len(entries) % 2 and _is_number(entries[0]):
        return [f"{what}: an odd number of blend entries ({len(entries)}: {' '.join(entries)}) — give weight and "
                f"prefix pairs: W1 PREFIX1 W2 PREFIX2 ..."]
    weighted = len(entries) % 2 == 0 and all(_is_number(e) for e in entries[::2])
    prefixes = entries[1::2] if weighted else entries
    errors: List[str] = []
    for weight, prefix in zip(entries[::2], prefixes) if weighted else ():
        # megatron-core 0.16.1 normalises the weights and its BlendedDataset asserts each is > 0: a zero weight
        # (a common way to switch a dataset off) fails there, after every index was built
        if not 0 < float(weight) < float("inf"):
            errors.append(f"{what}: weight {weight} for {prefix} — Megatron blends take positive weights only "
                          f"(megatron-core's BlendedDataset); leave the dataset out of the list to switch it off")
    for prefix in prefixes:
        if prefix.endswith(RAW_SUFFIXES):
            errors += _raw_errors(what, prefix, config)
        elif prefix.endswith((".bin", ".idx")):
            errors.append(f"{what}: {prefix} names one file of the indexed pair — give its prefix "
                          f"{prefix[:-4]} (without .bin/.idx), as Megatron's --data-path takes it")
        elif not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
            errors.append(f"{what}: {prefix}.bin/.idx not found{_did_you_mean(prefix)} — give the prefix of files "
                          f"written by preprocess_data.py, or a raw .jsonl/.jsonl.gz/.parquet file")
        else:
            broken = _pair_problems(prefix)  # a truncated pair: found before the model is built
            errors += [f"{what}: {message}" for message in broken] or _cache_errors(prefix, config)
    return errors


def _pair_problems(prefix: str) -> List[str]:
    """What opening the indexed pair refuses (a truncated or mismatched .idx/.bin), as messages; [] when it opens."""
    from megatron_compat.data.indexed_dataset import IndexedDataset

    try:
        IndexedDataset(prefix)
    except UsageError as exc:
        return exc.messages
    return []


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _did_you_mean(prefix: str) -> str:
    """"; did you mean P?" with the closest .bin/.idx prefixes in the same folder, or ""."""
    folder = os.path.dirname(prefix) or "."
    try:
        names = os.listdir(folder)
    except OSError:
        return ""
    candidates = sorted(n[:-4] for n in names if n.endswith(".bin") and f"{n[:-4]}.idx" in names)
    close = difflib.get_close_matches(os.path.basename(prefix), candidates, n=3, cutoff=0.5)
    if not close:
        return ""
    return "; did you mean " + " or ".join(os.path.join(os.path.dirname(prefix), c) for c in close) + "?"


def _did_you_mean_dir(path: str) -> str:
    """"; did you mean P?" with the closest folders beside a missing one (a mistyped `iter_0000300` for
    `iter_0000030`, `ckpts` for `ckpt`), or ""."""
    path = os.path.expanduser(path.rstrip("/"))
    folder = os.path.dirname(path) or "."
    try:
        names = sorted(n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n)))
    except OSError:
        return ""
    close = difflib.get_close_matches(os.path.basename(path), names, n=3, cutoff=0.6)
    return "; did you mean " + " or ".join(os.path.join(folder, c) for c in close) + "?" if close else ""


def _unwritable(path: str) -> Optional[str]:
    """The existing folder that stops `path` from being created or written, or None when it can be."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return None if os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK) else existing


def _cache_errors(prefix: str, config: Config) -> List[str]:
    cache = config.data.data_cache_path
    target = cache or os.path.join(prefix, INDEX_CACHE_DIR)
    if os.path.isdir(target) and cache is None:
        return []  # caches from an earlier run: read, and written only for new settings
    blocker = _unwritable(target)
    if blocker is None:
        return []
    where = "data.data_cache_path (--data-cache-path)"
    if cache:
        return [f"{where}: {cache} cannot be written ({blocker} is not writable) — give a folder you can write to"]
    return [f"{where}: the dataset index caches of {prefix} go to {target} by default, and {blocker} is not "
            f"writable — set --data-cache-path (data.data_cache_path) to a folder you can write to"]


def _raw_errors(what: str, raw: str, config: Config) -> List[str]:
    if not os.path.isfile(raw):
        return [f"{what}: {raw} not found{_did_you_mean(raw)} — give an existing raw data file, or the prefix of "
                f"files written by preprocess_data.py"]
    name = os.path.basename(raw)
    name = next(name[: -len(s)] for s in RAW_SUFFIXES if name.endswith(s))
    folder = config.data.tokenized_path or os.path.join(os.path.dirname(os.path.abspath(raw)), f"{name}_tokenized")
    if os.path.isdir(folder) and any(f.endswith(".idx") for f in os.listdir(folder)) and not config.data.overwrite_cache:
        return []  # tokenized by an earlier run: read only
    blocker = _unwritable(folder)
    if blocker is None:
        return []
    return [f"data.tokenized_path: {raw} is tokenized into {folder}, and {blocker} is not writable — set "
            f"data.tokenized_path (--data.tokenized_path) to a folder you can write to"]
