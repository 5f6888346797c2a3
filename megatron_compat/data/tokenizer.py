"""Megatron's `--tokenizer-type` tokenizers, for preprocessing and for training.

`build_tokenizer(tokenizer_type, ...)` returns an object with megatron's tokenizer surface: `tokenize(text)`
-> ids, `detokenize(ids)`, `eod`, `bos`, `pad`, `vocab_size`; plus `tokenize_batch(texts)` (one call into the
tokenizer library for many texts, same ids as `tokenize` on each). The ids are those of megatron-core
0.16.1's tokenizers (what Megatron-LM's current `tools/preprocess_data.py` uses):

- HuggingFaceTokenizer (`--tokenizer-model`): the ids of `AutoTokenizer.tokenize(text)`, without the
  post-processor's special tokens (no BOS) unless `include_special_tokens`
  (`--tokenizer-hf-include-special-tokens`), as megatron-core 0.16.1 does; eod = eos (sep when there is no
  eos), vocab_size = len(tokenizer) (added tokens included).
- MindSpeed's PretrainedFromHF (`--tokenizer-name-or-path`): `AutoTokenizer(text).input_ids`, special
  tokens included (e.g. a BOS), as MindSpeed-LLM does.
- SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: `encode_as_ids(text)` (megatron-core
  treats the three alike: no BOS is added), eod = eos id, vocab_size = the model's piece count.
- GPT2BPETokenizer (`--vocab-file`, `--merge-file`): GPT-2's byte-level BPE, `<|endoftext|>` is the eod
  and is recognised in text.
- NullTokenizer (`--vocab-size N`): ids written as space-separated integers; eod = N, vocab_size = N + 1.
- TikTokenizer (`--tokenizer-model VOCAB.json`, `--tiktoken-pattern`, `--tiktoken-num-special-tokens`,
  `--tokenizer-special-tokens`, `--vocab-size`): Megatron's tiktoken vocabulary, see `tiktoken_tokenizer`.

Tokenizers pickle as their construction arguments, so worker processes rebuild rather than copy them.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

from megatron_compat.data import tokenizer_identity
from fsdp2_backend.usage_errors import UsageError

HF_TYPES = ("HuggingFaceTokenizer", "PretrainedFromHF")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = HF_TYPES + SENTENCEPIECE_TYPES + ("GPT2BPETokenizer", "NullTokenizer", "TikTokenizer")


class _Tokenizer:
    """Shared surface: batch tokenisation by default loops over `tokenize`; pickling rebuilds."""

    tokenizer_type: str

    def __init__(self, **init_kwargs) -> None:
        self._init_kwargs = init_kwargs

    def __reduce__(self):
        return _construct, (type(self), self._init_kwargs)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]

    bos: Optional[int] = None
    pad: Optional[int] = None
    hf = None  # the transformers tokenizer inside, for HF-backed types (what checkpoints and exports save)


def _construct(cls, init_kwargs: dict) -> "_Tokenizer":
    return cls(**init_kwargs)


def _require_file(flag: str, path: Optional[str], tokenizer_type: str) -> str:
    if not path:
        raise UsageError(f"{flag}: required by --tokenizer-type {tokenizer_type} — give the path")
    if not os.path.exists(path):
        raise UsageError(f"{flag}: {path} not found — check the path")
    return path


class HuggingFaceTokenizer(_Tokenizer):
    """A transformers tokenizer from a local directory (or a hub name when the hub is reachable)."""

    tokenizer_type = "HuggingFaceTokenizer"

    def __init__(self, name_or_path: str, flag: str = "--tokenizer-model", trust_remote_code: bool = False,
                 use_fast: bool = True, tokenizer_type: str = "HuggingFaceTokenizer",
                 include_special_tokens: bool = False) -> None:
        self.tokenizer_type = tokenizer_type
        self.include_special_tokens = include_special_tokens
        super().__init__(name_or_path=name_or_path, flag=flag, trust_remote_code=trust_remote_code,
                         use_fast=use_fast, tokenizer_type=tokenizer_type,
                         include_special_tokens=include_special_tokens)
        from megatron_compat.data.hf_tokenizer_class import generic_backend_applies

        try:
            if generic_backend_applies(name_or_path):
                # the class AutoTokenizer would load, without the torch import its config machinery brings
                from transformers.tokenization_utils_tokenizers import TokenizersBackend

                self.hf = TokenizersBackend.from_pretrained(name_or_path, _from_auto=True)
            else:
                from transformers import AutoTokenizer

                self.hf = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                        use_fast=use_fast)
        except (OSError, ValueError) as exc:
            if "custom code" in str(exc) and not trust_remote_code:  # an auto_map: code shipped with the files
                raise UsageError(f"{flag}: {os.path.join(name_or_path, 'tokenizer_config.json')} (or its "
                                 f"config.json) names custom tokenizer code (auto_map), which runs only with "
                                 f"--trust-remote-code — give it only for a directory you trust") from None
            where = "not found" if not os.path.exists(name_or_path) else "cannot be loaded"
            raise UsageError(f"{flag}: tokenizer {name_or_path} {where} ({str(exc).splitlines()[0]}) — give "
                             "a local tokenizer directory (tokenizer.json / tokenizer_config.json)") from None
        self._read_ids()
        if tokenizer_type == "HuggingFaceTokenizer":  # megatron-core's cache names (tokenizer_identity)
            self.unique_identifiers = tokenizer_identity.huggingface(name_or_path, use_fast, trust_remote_code)

    @classmethod
    def from_hf(cls, hf, tokenizer_type: str = "PretrainedFromHF",
                include_special_tokens: bool = True) -> "HuggingFaceTokenizer":
        """Wraps an already loaded transformers tokenizer (e.g. one with added tokens); pickles with it."""
        self = cls.__new__(cls)
        self._init_kwargs = None
        self.tokenizer_type, self.include_special_tokens, self.hf = tokenizer_type, include_special_tokens, hf
        self._read_ids()
        return self

    def __reduce__(self):
        if self._init_kwargs is None:
            return HuggingFaceTokenizer.from_hf, (self.hf, self.tokenizer_type, self.include_special_tokens)
        return super().__reduce__()

    def _read_ids(self) -> None:
        """The ids Megatron's data code reads (eod = eos, else sep, as megatron-core's HF wrapper), after any
        tokens were added."""
        hf = self.hf
        self.eod = hf.eos_token_id if hf.eos_token_id is not None else hf.sep_token_id
        self.bos = hf.bos_token_id
        self.pad = hf.pad_token_id
        self.vocab_size = len(hf)
        # the Rust tokenizer behind a fast tokenizer: `hf(text)` is `backend.encode_batch([text])`
        self.backend = getattr(hf, "backend_tokenizer", None)
        self.unique_identifiers = {"class": type(hf).__name__, "name_or_path": getattr(hf, "name_or_path", None),
                                   "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> List[int]:
        return self.hf(text, add_special_tokens=self.include_special_tokens).input_ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if self.backend is None:
            return self.hf(list(texts), add_special_tokens=self.include_special_tokens).input_ids
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=self.include_special_tokens)
        return [encoding.ids for encoding in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))


class SentencePieceTokenizer(_Tokenizer):
    """A SentencePiece model file."""

    def __init__(self, model_file: str, tokenizer_type: str = "SentencePieceTokenizer") -> None:
        self.tokenizer_type = tokenizer_type
        super().__init__(model_file=model_file, tokenizer_type=tokenizer_type)
        import sentencepiece

        _require_file("--tokenizer-model", model_file, tokenizer_type)
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as exc:
            raise UsageError(f"--tokenizer-model: {model_file} is not a SentencePiece model ({exc}) — give "
                             "the tokenizer.model file") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.unique_identifiers = tokenizer_identity.sentencepiece(model_file)

    def tokenize(self, text: str) -> List[int]:
        return self.sp.encode_as_ids(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.sp.encode(list(texts), num_threads=1)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.sp.decode_ids(list(ids))


class GPT2BPETokenizer(HuggingFaceTokenizer):
    """GPT-2's byte-level BPE from `vocab.json` and `merges.txt`."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        _require_file("--vocab-file", vocab_file, "GPT2BPETokenizer")
        _require_file("--merge-file", merge_file, "GPT2BPETokenizer")
        self.tokenizer_type = "GPT2BPETokenizer"
        _Tokenizer.__init__(self, vocab_file=vocab_file, merge_file=merge_file)
        self.include_special_tokens = False
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        try:  # GPT-2's pipeline: byte-level pre-tokenizer (GPT-2 regex), BPE, <|endoftext|> as special token
            bpe = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        except Exception as exc:  # the tokenizers library raises plain Exceptions on malformed files
            raise UsageError(f"--vocab-file/--merge-file: {vocab_file}, {merge_file} are not a GPT-2 BPE "
                             f"vocabulary ({str(exc).splitlines()[0]}) — give GPT-2 style vocab.json and "
                             "merges.txt") from None
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        bpe.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
        self.hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
        self.eod = self.hf.convert_tokens_to_ids("<|endoftext|>")
        self.bos = self.pad = None
        self.vocab_size = len(self.hf)
        self.backend = self.hf.backend_tokenizer
        self.unique_identifiers = tokenizer_identity.gpt2_bpe(vocab_file, merge_file)


class NullTokenizer(_Tokenizer):
    """Text that already is space-separated token ids."""

    tokenizer_type = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise UsageError("--vocab-size: required (a positive integer) by --tokenizer-type NullTokenizer — "
                             "give the vocabulary size without the eod token")
        super().__init__(vocab_size=int(vocab_size))
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1
        self.unique_identifiers = tokenizer_identity.null(int(vocab_size))

    def tokenize(self, text: str) -> List[int]:
        try:
            return [int(x) for x in text.split(" ")]
        except ValueError:
            raise UsageError(f"NullTokenizer: text {text[:40]!r} is not space-separated integers — give ids "
                             "or pick another --tokenizer-type") from None

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(x) for x in ids)


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None,
                    tokenizer_name_or_path: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, vocab_size: Optional[int] = None,
                    trust_remote_code: bool = False, use_fast: bool = True,
                    include_special_tokens: Optional[bool] = None, tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: Optional[int] = None, special_tokens: Optional[Sequence[str]] = None,
                    **_ignored):
    """The tokenizer Megatron builds for `--tokenizer-type` (see the module docstring for each type).

    `include_special_tokens` (HF types only) defaults to False for HuggingFaceTokenizer (megatron-core) and
    True for PretrainedFromHF (MindSpeed). Extra keyword arguments (e.g. the rest of an argparse namespace's tokenizer fields) are ignored.
    """
    if special_tokens and tokenizer_type != "TikTokenizer":
        raise UsageError(f"--tokenizer-special-tokens: only read for --tokenizer-type TikTokenizer here, not "
                         f"{tokenizer_type} — add the tokens to the tokenizer directory instead")
    if tokenizer_type in ("HuggingFaceTokenizer", "PretrainedFromHF"):
        flag, path = (("--tokenizer-model", tokenizer_model or tokenizer_name_or_path)
                      if tokenizer_type == "HuggingFaceTokenizer"
                      else ("--tokenizer-name-or-path", tokenizer_name_or_path or tokenizer_model))
        if not path:
            raise UsageError(f"{flag}: required by --tokenizer-type {tokenizer_type} — give the tokenizer "
                             "directory")
        if include_special_tokens is None:
            include_special_tokens = tokenizer_type == "PretrainedFromHF"
        return HuggingFaceTokenizer(path, flag=flag, trust_remote_code=trust_remote_code, use_fast=use_fast,
                                    tokenizer_type=tokenizer_type, include_special_tokens=include_special_tokens)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type=tokenizer_type)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "TikTokenizer":
        from megatron_compat.data.tiktoken_tokenizer import TikTokenizer

        return TikTokenizer(tokenizer_model, pattern=tiktoken_pattern, vocab_size=vocab_size,
                            num_special_tokens=tiktoken_num_special_tokens, special_tokens=special_tokens)
    raise UsageError(f"--tokenizer-type: {tokenizer_type!r} is not supported — use one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def build_tokenizer_from_args(args) -> "_Tokenizer":
    """`build_tokenizer` from an argparse namespace or config object with Megatron's field names."""
    fields = ("tokenizer_type", "tokenizer_model", "tokenizer_name_or_path", "vocab_file", "merge_file",
              "vocab_size", "trust_remote_code", "include_special_tokens", "tiktoken_pattern",
              "tiktoken_num_special_tokens", "special_tokens")
    values = {name: getattr(args, name, None) for name in fields if getattr(args, name, None) is not None}
    if "tokenizer_type" not in values and "tokenizer_name_or_path" in values:
        values["tokenizer_type"] = "PretrainedFromHF"  # the seed's native configs name only a path
    if "tokenizer_type" not in values:
        raise UsageError("--tokenizer-type: not given — name a tokenizer type (e.g. HuggingFaceTokenizer)")
    return build_tokenizer(**values)
