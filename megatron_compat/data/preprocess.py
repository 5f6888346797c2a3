"""Raw text (.jsonl, .jsonl.gz, .parquet) to Megatron `.bin/.idx` files: the engine of preprocess_data.py.

`preprocess_files(inputs, output_prefix, json_keys, tokenizer, append_eod, workers, ...)` writes
`{output_prefix}_{key}_{document|sentence}.bin/.idx` per JSON key, byte-identical to Megatron-LM's
`tools/preprocess_data.py` for the same input and tokenizer, documents in the same order (with
`partitions > 1`, Megatron's round-robin partition order unless `keep_sequential_samples`).

How it is fast and lean: the main process streams records in batches of about 1 MiB to worker processes
(a bounded number in flight, so memory stays flat whatever the input size) and appends their packed tokens
to the builders in input order; workers tokenize whole batches in one library call, through tiktoken when
`fast_bpe.select_fast_path` (HF byte-level BPE) or `fast_spm.select_fast_path` (SentencePiece BPE) finds it
reproduces the tokenizer on the input's first batch.
A worker that dies ends the run (`BrokenProcessPool`), never a hang. Outputs are written under `.partial`
names and renamed only when every key is complete.
"""
from __future__ import annotations

import glob
import gzip
import itertools
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, TextIO, Union

from fsdp2_backend.checkpoint.atomic import publish
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.data import fast_bpe, fast_spm
from megatron_compat.data.indexed_dataset import DType, IndexedDatasetBuilder, get_bin_path, get_idx_path
from megatron_compat.data.preprocess_worker import EncodeSettings, Encoder, parse_line
from megatron_compat.data.tokenizer import SENTENCEPIECE_TYPES

_JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
_SAMPLE_TEXTS = 64  # texts of the first batch the fast path is checked on,
_SAMPLE_CHARS = 256_000  # at most this many characters in all (the check runs the slow tokenizer)


def output_prefix_for(output_prefix: str, key: str, split_sentences: bool = False) -> str:
    """The prefix Megatron's tool gives the dataset of one JSON key."""
    return f"{output_prefix}_{key}_{'sentence' if split_sentences else 'document'}"


def expand_inputs(inputs: Union[str, Sequence[str]]) -> List[str]:
    """Input files from paths and glob patterns (sorted per pattern); UsageError when one matches nothing."""
    paths = []
    for pattern in [inputs] if isinstance(inputs, str) else inputs:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.isfile(p) for p in matches):
            raise UsageError(f"--input: {pattern}: no such file — check the path or glob")
        for path in matches:
            if not (path.endswith(_JSONL_SUFFIXES) or path.endswith(".parquet")):
                raise UsageError(f"--input: {path}: unsupported file type — give .jsonl, .jsonl.gz or .parquet")
        paths.extend(matches)
    return paths


def _records(path: str, json_keys: Sequence[str]) -> Iterator[tuple]:
    """(line number, raw line or row dict, size in bytes) for every non-blank record of one file."""
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"--input: {path}: reading parquet needs pyarrow — pip install pyarrow") from None
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(columns=list(json_keys)):
            for record in batch.to_pylist():
                row += 1
                yield row, record, sum(len(v) for v in record.values() if isinstance(v, str))
        return
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as stream:
            for number, line in enumerate(stream, start=1):
                if line.strip():  # Megatron fails on a blank line; a trailing one is common and harmless
                    yield number, line, len(line)
    except (gzip.BadGzipFile, EOFError) as exc:
        raise UsageError(f"--input: {path}: broken gzip file ({exc}) — re-compress or decompress it") from None


@dataclass
class _Batch:
    path: str
    line_numbers: List[int] = field(default_factory=list)
    records: list = field(default_factory=list)
    sizes: List[int] = field(default_factory=list)


def _batches(paths: Sequence[str], json_keys, partitions: int, keep_sequential: bool, max_docs: int,
             max_bytes: int) -> Iterator[_Batch]:
    """Batches in Megatron's output order: with P round-robin partitions, pass p keeps records i % P == p."""
    passes = partitions if partitions > 1 and not keep_sequential else 1
    for part in range(passes):
        index = -1
        for path in paths:
            batch, nbytes = _Batch(path), 0
            for number, record, size in _records(path, json_keys):
                index += 1
                if index % passes != part:
                    continue
                batch.line_numbers.append(number)
                batch.records.append(record)
                batch.sizes.append(size)
                nbytes += size
                if len(batch.records) >= max_docs or nbytes >= max_bytes:
                    yield batch
                    batch, nbytes = _Batch(path), 0
            if batch.records:
                yield batch


# A pool worker's Encoder: ProcessPoolExecutor hands per-process state to tasks only through a module
# global set by its initializer; it is set in worker processes only.
_worker_encoder: Optional[Encoder] = None


def _init_worker(encoder: Encoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(path, line_numbers, records):
    return _worker_encoder.encode_batch(path, line_numbers, records)


def _encoded(encoder: Encoder, batches: Iterable[_Batch], workers: int) -> Iterator[tuple]:
    """(batch, packed tokens) in input order; at most 2*workers+2 batches in flight."""
    if workers <= 1:
        for batch in batches:
            yield batch, encoder.encode_batch(batch.path, batch.line_numbers, batch.records)
        return
    # fork: workers inherit the loaded tokenizer and fast path instead of re-importing and rebuilding them
    executor = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_init_worker, initargs=(encoder,))
    try:
        pending = deque()
        for batch in batches:
            pending.append((batch, executor.submit(_encode_in_worker, batch.path, batch.line_numbers,
                                                   batch.records)))
            if len(pending) >= 2 * workers + 2:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _sample_texts(batch: _Batch, key: str) -> List[str]:
    texts, budget = [], _SAMPLE_CHARS
    for n, record in enumerate(batch.records[:_SAMPLE_TEXTS]):
        if not isinstance(record, dict):
            record = parse_line(record, f"{batch.path} line {batch.line_numbers[n]}")
        value = record.get(key)
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and budget > 0:
                texts.append(text[:budget])
                budget -= len(texts[-1])
    return texts


class _Progress:
    """Megatron's progress line every `log_interval` documents."""

    def __init__(self, log_interval: int, log: TextIO) -> None:
        self.log_interval, self.log = log_interval, log
        self.count, self.nbytes, self.start = 0, 0, time.time()

    def add(self, sizes: Sequence[int]) -> None:
        for size in sizes:
            self.count += 1
            self.nbytes += size
            if self.count % self.log_interval == 0:
                elapsed = time.time() - self.start
                print(f"Processed {self.count} documents", f"({self.count / elapsed} docs/s, "
                      f"{self.nbytes / elapsed / 1024 / 1024} MB/s).", file=self.log, flush=True)


def _megatron_surface(tokenizer):
    """`tokenizer` with megatron_compat's surface (`tokenize_batch`, `eod`, `vocab_size` with added tokens,
    `tokenizer_type`): a transformers tokenizer is wrapped as PretrainedFromHF, as the engine's
    `load_tokenizer` does; anything else is returned as is."""
    if hasattr(tokenizer, "tokenize_batch") or not callable(getattr(tokenizer, "convert_tokens_to_ids", None)):
        return tokenizer
    from megatron_compat.data.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer.from_hf(tokenizer)


def preprocess_files(inputs: Union[str, Sequence[str]], output_prefix: str, json_keys: Sequence[str] = ("text",),
                     tokenizer=None, append_eod: bool = False, workers: int = 1, split_sentences: bool = False,
                     keep_newlines: bool = False, lang: str = "english", partitions: int = 1,
                     keep_sequential_samples: bool = False, log_interval: int = 1000, batch_docs: int = 1000,
                     batch_bytes: int = 1 << 20, fast: bool = True, skip_empty: Optional[bool] = None,
                     log: Optional[TextIO] = None) -> Dict[str, str]:
    """Tokenizes `inputs` into one indexed dataset per JSON key; returns {key: dataset prefix}.

    `tokenizer` comes from `megatron_compat.data.tokenizer.build_tokenizer` (or is a transformers tokenizer,
    then read as PretrainedFromHF: `tokenizer(text)` ids, special tokens included). `fast=False` disables the
    tiktoken fast paths. `skip_empty` applies MindSpeed-LLM's rules (empty sentences not tokenized, documents
    without ids left out); by default it follows the tokenizer type (PretrainedFromHF is MindSpeed's).
    Messages (tokenizer choice, progress) go to `log` (stderr by default).
    """
    log = log or sys.stderr
    problems = []
    if workers < 1:
        problems.append(f"--workers: {workers} — give at least 1")
    if partitions < 1 or workers % max(partitions, 1):
        problems.append(f"--workers {workers} / --partitions {partitions}: workers must be a multiple of "
                        "partitions (Megatron gives workers/partitions to each partition)")
    if log_interval < 1:
        problems.append(f"--log-interval: {log_interval} — give a positive number of documents")
    if not json_keys:
        problems.append("--json-keys: empty — name at least one key")
    if tokenizer is None:
        problems.append("tokenizer: none given — build one with megatron_compat.data.tokenizer.build_tokenizer")
    if problems:
        raise UsageError(problems)
    tokenizer = _megatron_surface(tokenizer)
    paths = expand_inputs(inputs)
    for path in paths:
        print(f"Opening {path}", file=log)
    startup = time.time()
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    if skip_empty is None:
        skip_empty = getattr(tokenizer, "tokenizer_type", None) == "PretrainedFromHF"
    settings = EncodeSettings(list(json_keys), append_eod, dtype, split_sentences, keep_newlines, lang, skip_empty)
    batches = _batches(paths, json_keys, partitions, keep_sequential_samples, batch_docs, batch_bytes)
    first = next(batches, None)
    if first is None:  # Megatron writes an empty dataset here, which only fails later, at training
        raise UsageError(f"--input: {', '.join(paths)}: no records to tokenize (empty input) — nothing was "
                         "written; check the input file")
    fast_path = None
    if fast and first is not None:
        select = (fast_spm if getattr(tokenizer, "tokenizer_type", None) in SENTENCEPIECE_TYPES
                  else fast_bpe).select_fast_path
        fast_path, why = select(tokenizer, _sample_texts(first, json_keys[0]))
        print(f"Tokenizer: {why}" if fast_path else f"Tokenizer: {tokenizer.tokenizer_type} ({why})", file=log)
    encoder = Encoder(settings, tokenizer, fast_path)

    prefixes = {key: output_prefix_for(output_prefix, key, split_sentences) for key in json_keys}
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    partial = {key: (get_bin_path(p) + ".partial", get_idx_path(p) + ".partial") for key, p in prefixes.items()}
    builders = {}
    try:
        for key, (bin_tmp, _) in partial.items():
            builders[key] = IndexedDatasetBuilder(bin_tmp, dtype=dtype)
        print(f"Time to startup: {time.time() - startup}", file=log)
        progress = _Progress(log_interval, log)
        stream = ([first] if first is not None else [])
        for batch, packed in _encoded(encoder, itertools.chain(stream, batches), workers):
            for key, (token_bytes, lengths, per_doc) in packed.items():
                builders[key].add_documents(token_bytes, lengths, per_doc)
            progress.add(batch.sizes)
        for key, (_, idx_tmp) in partial.items():
            builders[key].finalize(idx_tmp)
        for key, (bin_tmp, idx_tmp) in partial.items():
            publish(bin_tmp, get_bin_path(prefixes[key]))  # fsync'd, then renamed
            publish(idx_tmp, get_idx_path(prefixes[key]))
    except BaseException:
        for builder in builders.values():
            builder.data_file.close()
        for tmp in (p for pair in partial.values() for p in pair):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    return prefixes


def outputs_complete(prefixes: Iterable[str]) -> bool:
    """Whether every dataset of a finished run is there (a failed run leaves only `.partial` files)."""
    return all(os.path.isfile(get_bin_path(p)) and os.path.isfile(get_idx_path(p)) for p in prefixes)
