"""The per-batch work of preprocessing: parse records, split sentences, tokenize, pack tokens for a builder.

Megatron's per-document rules, applied to a batch at once (`encode_batch`):
- a JSON value that is a list is taken as the document's sentences; a string is one sentence, or is split by
  NLTK punkt with `--split-sentences` (in chunks of 1,000,000 characters, as Megatron does);
- sentences whose ids are empty are dropped; with `append_eod` the eod id is added to the document's last
  sentence; a document with no ids stays as an empty document (no eod).
With `skip_empty` (MindSpeed-LLM's GeneralPretrainHandler rules): empty sentence strings are not tokenized
and documents without ids are left out of the index.
A batch returns, per JSON key, the tokens as bytes in the output dtype, every sentence length and the number
of sentences of each document: exactly what `IndexedDatasetBuilder.add_documents` takes.
"""
from __future__ import annotations

import json
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from fsdp2_backend.usage_errors import UsageError

_SPLIT_CHUNK_CHARS = 1_000_000
_ARRAY_TYPECODE = {numpy.uint8: "B", numpy.int8: "b", numpy.int16: "h", numpy.int32: "i", numpy.int64: "q",
                   numpy.uint16: "H"}


def build_sentence_splitter(lang: str, keep_newlines: bool):
    """NLTK punkt for `lang` (keeping newlines after sentences when asked); UsageError when unavailable."""
    try:
        import nltk
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer
    except ImportError:
        raise UsageError("--split-sentences: needs NLTK, which is not installed — pip install nltk, then "
                         "python -m nltk.downloader punkt") from None
    try:
        try:  # nltk >= 3.8.2 reads punkt from its `punkt_tab` data and no longer loads pickles
            from nltk.tokenize.punkt import PunktTokenizer
        except ImportError:
            splitter = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
        else:
            splitter = PunktTokenizer(lang)
    except (LookupError, OSError, ValueError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip(" *")]
        raise UsageError(f"--lang {lang}: NLTK punkt data not found ({lines[0] if lines else exc}) — run "
                         "python -m nltk.downloader punkt_tab (set NLTK_DATA to where it is)") from None
    if not keep_newlines:
        return splitter

    class _KeepNewlines(PunktLanguageVars):
        # punkt's period context with `\s*` instead of `\s+` before the next token, so the whitespace
        # (newlines included) after a sentence end stays attached to the sentence (Megatron's variant)
        _period_context_fmt = r"""
            \S*
            %(SentEndChars)s
            \s*
            (?=(?P<after_tok>
                %(NonWord)s
                |
                (?P<next_tok>\S+)
            ))"""

    return PunktSentenceTokenizer(train_text=splitter._params, lang_vars=_KeepNewlines())


@dataclass
class EncodeSettings:
    """What every batch needs to know (sent once to each worker)."""

    json_keys: Sequence[str]
    append_eod: bool
    dtype: type
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"
    skip_empty: bool = False


@dataclass
class Encoder:
    """Turns batches of records into packed tokens; one per process."""

    settings: EncodeSettings
    tokenizer: object  # megatron_compat.data.tokenizer tokenizer
    fast: Optional[object] = None  # fast_bpe.TiktokenBPE or fast_spm.TiktokenSentencePiece when selected
    splitter: Optional[object] = field(default=None)

    def __post_init__(self) -> None:
        if self.settings.split_sentences and self.splitter is None:
            self.splitter = build_sentence_splitter(self.settings.lang, self.settings.keep_newlines)
        if self.settings.append_eod and self.tokenizer.eod is None:
            raise UsageError("--append-eod: the tokenizer has no end-of-document (eos) token — add one to the "
                             "tokenizer or drop --append-eod")

    def _sentences(self, value, where: str, key: str) -> List[str]:
        if isinstance(value, str):
            if self.splitter is None:
                sentences = [value]
            else:
                sentences = [s for i in range(0, len(value), _SPLIT_CHUNK_CHARS)
                             for s in self.splitter.tokenize(value[i:i + _SPLIT_CHUNK_CHARS])]
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            sentences = value
        else:
            sentences = None
        if sentences is not None:
            return [s for s in sentences if s] if self.settings.skip_empty else sentences
        raise UsageError(f"{where}: key {key!r} is a {type(value).__name__}, not text — give a string (or a list "
                         "of sentence strings)")

    def encode_batch(self, path: str, line_numbers: Sequence[int], records: Sequence
                     ) -> Dict[str, Tuple[bytes, numpy.ndarray, numpy.ndarray]]:
        """Packs a batch of raw JSON lines (bytes/str) or already-parsed dicts (`line_numbers` for errors)."""
        keys = self.settings.json_keys
        texts = {key: [] for key in keys}
        owners = {key: [] for key in keys}
        for n, record in enumerate(records):
            where = f"{path} line {line_numbers[n]}"
            if not isinstance(record, dict):
                record = parse_line(record, where)
            for key in keys:
                if key not in record:
                    raise UsageError(f"{where}: key {key!r} missing (the record has: "
                                     f"{', '.join(map(str, record)) or 'no keys'}) — check --json-keys")
                sentences = self._sentences(record[key], where, key)
                texts[key].extend(sentences)
                owners[key].extend([n] * len(sentences))
        tokenize_batch = (self.fast or self.tokenizer).tokenize_batch
        return {key: self._pack(tokenize_batch(texts[key]), owners[key], len(records)) for key in keys}

    def _pack(self, ids: List[List[int]], owners: List[int], n_docs: int):
        lengths = numpy.fromiter(map(len, ids), dtype=numpy.int64, count=len(ids))
        nonempty = numpy.flatnonzero(lengths)
        owner = numpy.asarray(owners, dtype=numpy.int64)
        if self.settings.append_eod and len(nonempty):
            # the last non-empty sentence of each document gets the eod
            doc_of = owner[nonempty]
            last = nonempty[numpy.r_[doc_of[1:] != doc_of[:-1], True]]
            eod = self.tokenizer.eod
            for i in last.tolist():
                ids[i] = ids[i] + [eod]
            lengths[last] += 1
        tokens = array(_ARRAY_TYPECODE[self.settings.dtype])
        for i in nonempty.tolist():
            tokens.extend(ids[i])
        per_doc = numpy.bincount(owner[nonempty], minlength=n_docs)
        if self.settings.skip_empty:
            per_doc = per_doc[per_doc > 0]
        return tokens.tobytes(), lengths[nonempty].astype(numpy.int32), per_doc


def parse_line(line, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        what = exc.msg[:-len(" at")] if exc.msg.endswith(" at") else exc.msg  # "Invalid control character at"
        raise UsageError(f"{where}: invalid JSON ({what} at column {exc.colno}) — fix or remove the line") \
            from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start}) — re-encode the file as "
                         "UTF-8") from None
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object — each line must be one "
                         "JSON object")
    return record
