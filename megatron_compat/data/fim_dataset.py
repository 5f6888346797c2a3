"""`GPTFIMDatasetConfig`, `GPTFIMDataset`: Megatron-LM's fill-in-the-middle GPT dataset (`--fim-data`).

megatron-core 0.16.1 has no FIM dataset; Megatron-LM keeps it in `megatron/training/datasets/fim_dataset.py`
(a `GPTDataset` subclass, chosen by `pretrain_gpt.py` with `--fim-data`). Facts reproduced from it:
- The indices are GPTDataset's (same documents, samples, order); the class name joins the cache description,
  so caches are named as Megatron-LM's FIM runs name them.
- One `numpy.random.RandomState(random_seed)` per dataset object, advanced by every sample read: a sample's
  FIM depends on the order the dataset is read in, as in Megatron-LM (equal samples for the same read order).
- A sample (seq_length + 1 tokens) is cut at each FIM eod token (`--fim-eod-token`); each non-empty segment
  (and the part after the last eod, even when empty) is transformed and the eods put back between them
  (an empty segment drops its eod, as Megatron-LM does). With `--fim-split-sample TOKEN` a segment holding that
  token is transformed only with probability fim_rate, then each fragment between the tokens with
  `--fim-fragment-rate`.
- Transforming: with probability rate the tokens are decoded to text (special tokens removed), cut at two
  uniformly drawn character positions into prefix / middle / suffix, each re-encoded; with probability spm_rate
  SPM `<pre> <suf> suffix <mid> prefix middle`, else PSM `<pre> prefix <suf> suffix <mid> middle`. Text that
  starts with `--fim-no-prefix` is left alone.
- The result is cut to the sample's length or padded with the FIM pad token.
Tokens are looked up, decoded and encoded as megatron-core's tokenizer libraries do (`_codec`): HF-backed types
(convert_tokens_to_ids; decode without special tokens; encode with `tokenizer(text)` when special tokens are
included, else tokenize + convert) and TikTokenizer (special tokens by index; ids below the special count
dropped). For TikTokenizer the FIM and split tokens must be special tokens: Megatron-LM looks a split token up
character by character (asserting on a multi-character one) and shifts a non-special token's id twice, so only
special tokens have a meaning there. SentencePiece and Null tokenizers are declined for FIM (not implemented).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy

from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_compat.data.utils import Split
from fsdp2_backend.usage_errors import UsageError

FIM_TOKEN_ROLES = ("prefix", "middle", "suffix", "pad", "eod")
DEFAULT_FIM_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>",
                      "pad": "<fim_pad>", "eod": "<|endoftext|>"}


@dataclass
class GPTFIMDatasetConfig(GPTDatasetConfig):
    """Megatron-LM's FIM fields on top of GPTDatasetConfig."""

    fim_rate: Optional[float] = None
    fim_spm_rate: Optional[float] = None
    fim_extra_tokens: Optional[Dict[str, str]] = field(default=None)
    fim_split_sample: Optional[str] = None
    fim_fragment_rate: Optional[float] = None
    fim_no_prefix: Optional[str] = None


class _Codec:
    """token → id, ids → text (special tokens removed), text → ids, as megatron-core's tokenizer library."""

    def __init__(self, token_id: Callable[[str], Optional[int]], decode: Callable[[List[int]], str],
                 encode: Callable[[str], List[int]]) -> None:
        self.token_id, self.decode, self.encode = token_id, decode, encode


def _codec(tokenizer: Any) -> _Codec:
    kind = getattr(tokenizer, "tokenizer_type", type(tokenizer).__name__)
    if kind == "TikTokenizer":
        specials = {t: i for i, t in enumerate(tokenizer.special_tokens)}
        skip = {tokenizer.bos, tokenizer.eod}

        def decode(ids):
            return tokenizer.detokenize([i for i in ids if i not in skip and i >= tokenizer.num_special_tokens])

        return _Codec(specials.get, decode, tokenizer.tokenize)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        special = set(hf.all_special_tokens)
        include = getattr(tokenizer, "include_special_tokens", False)

        def token_id(token):
            ids = hf.convert_tokens_to_ids([token])
            return None if not ids or ids[0] is None or ids[0] == hf.unk_token_id else ids[0]

        def decode(ids):
            return hf.convert_tokens_to_string([t for t in hf.convert_ids_to_tokens(ids) if t not in special])

        def encode(text):
            return hf(text).input_ids if include else hf.convert_tokens_to_ids(hf.tokenize(text))

        return _Codec(token_id, decode, encode)
    raise UsageError(f"--fim-data: not implemented for --tokenizer-type {kind} — use an HF tokenizer "
                     "(HuggingFaceTokenizer) or TikTokenizer")


def fim_token_ids(tokenizer: Any, tokens: Dict[str, str], split_sample: Optional[str]) -> Tuple[Dict[str, int],
                                                                                                 Optional[int]]:
    """The ids of the five FIM tokens and of the split token; a token the vocabulary lacks is a usage error."""
    codec = _codec(tokenizer)
    ids, missing = {}, []
    for role in FIM_TOKEN_ROLES:
        ids[role] = codec.token_id(tokens[role])
        if ids[role] is None:
            missing.append(f"--fim-{role}-token {tokens[role]}")
    split_id = None
    if split_sample:
        split_id = codec.token_id(split_sample)
        if split_id is None:
            missing.append(f"--fim-split-sample {split_sample}")
    if missing:
        raise UsageError(f"--fim-data: {', '.join(missing)}: not a single token of the tokenizer's vocabulary — "
                         "name tokens the tokenizer has (its special tokens)")
    return ids, split_id


class GPTFIMDataset(GPTDataset):
    """GPTDataset whose samples are FIM-transformed (see the module docstring)."""

    def __init__(self, indexed_dataset: Any, dataset_path: Optional[str], indexed_indices: numpy.ndarray,
                 num_samples: Optional[int], index_split: Split, config: GPTFIMDatasetConfig) -> None:
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.np_rng = numpy.random.RandomState(seed=config.random_seed)
        self.fim_rate, self.fim_spm_rate = config.fim_rate, config.fim_spm_rate
        self.fragment_fim_rate, self.no_fim_prefix = config.fim_fragment_rate, config.fim_no_prefix
        self._codec = _codec(config.tokenizer)
        ids, self.fim_split_sample = fim_token_ids(config.tokenizer, config.fim_extra_tokens or DEFAULT_FIM_TOKENS,
                                                   config.fim_split_sample)
        (self.prefix_tok_id, self.middle_tok_id, self.suffix_tok_id, self.pad_tok_id,
         self.eod_tok_id) = (ids[role] for role in FIM_TOKEN_ROLES)

    def _query_document_sample_shuffle_indices(self, idx: int) -> Tuple[numpy.ndarray, numpy.ndarray]:
        sample, document_ids = super()._query_document_sample_shuffle_indices(idx)
        length = len(sample)
        pieces: List[Sequence[int]] = []
        start = 0
        for stop in numpy.flatnonzero(sample == self.eod_tok_id):
            if stop > start:  # an empty segment loses its eod (Megatron-LM's loop)
                pieces += [self._split_and_permute(sample[start:stop]), [self.eod_tok_id]]
            start = stop + 1
        pieces.append(self._split_and_permute(sample[start:]))
        out = numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in pieces])[:length]
        if len(out) < length:
            out = numpy.concatenate([out, numpy.full(length - len(out), self.pad_tok_id, dtype=numpy.int64)])
        return out, document_ids

    def _split_and_permute(self, tokens: numpy.ndarray) -> numpy.ndarray:
        """FIM on the segment, or (split token present) on each fragment once the segment is chosen."""
        breaks = (numpy.flatnonzero(tokens == self.fim_split_sample) if self.fim_split_sample is not None
                  else numpy.empty(0, dtype=numpy.int64))
        if len(breaks) == 0:
            return self._permute(tokens, self.fim_rate)
        if not self.np_rng.binomial(1, self.fim_rate):
            return tokens
        pieces: List[Sequence[int]] = []
        start = 0
        for stop in breaks:
            if stop > start:
                pieces += [self._permute(tokens[start:stop], self.fragment_fim_rate), [self.fim_split_sample]]
            start = stop + 1
        pieces.append(self._permute(tokens[start:], self.fragment_fim_rate))
        return numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in pieces])

    def _permute(self, tokens: numpy.ndarray, rate: float) -> numpy.ndarray:
        """One FIM draw on `tokens` (the RNG calls in Megatron-LM's order: apply?, two cut points, SPM?)."""
        if not self.np_rng.binomial(1, rate):
            return tokens
        text = self._codec.decode([int(t) for t in tokens])
        if self.no_fim_prefix is not None and text.startswith(self.no_fim_prefix):
            return tokens
        low, high = sorted(self.np_rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (numpy.asarray(self._codec.encode(part), dtype=numpy.int64)
                                  for part in (text[:low], text[low:high], text[high:]))
        if self.np_rng.binomial(1, self.fim_spm_rate):
            order = [[self.prefix_tok_id, self.suffix_tok_id], suffix, [self.middle_tok_id], prefix, middle]
        else:
            order = [[self.prefix_tok_id], prefix, [self.suffix_tok_id], suffix, [self.middle_tok_id], middle]
        return numpy.concatenate([numpy.asarray(p, dtype=numpy.int64) for p in order])
