"""The `unique_identifiers` Megatron's tokenizers put into the dataset cache description, so that our index
caches carry megatron-core's names (md5 of the description) and each side finds the other's.

Facts (megatron-core 0.16.1, `tokenizers/text/utils/build_tokenizer.py`, `text_tokenizer.py`): Megatron
builds its training tokenizer with `MegatronTokenizer.from_pretrained(tokenizer_path, {"library": ...},
**kwargs)`, a `DefaultTokenizerText` whose identifiers are its class as `module.qualname`, `tokenizer_path`,
then every keyword argument as `str(value)`, in the order `build_tokenizer` passes them:
- HuggingFaceTokenizer: path = --tokenizer-model; vocab_file, merges_file, additional_special_tokens ([]
  unless --tokenizer-special-tokens), use_fast, trust_remote_code, include_special_tokens.
- SentencePiece types: path = --tokenizer-model; legacy (--tokenizer-sentencepiece-legacy), special_tokens.
- GPT2BPETokenizer: path = the type name; additional_special_tokens, vocab_file, merges_file, use_fast,
  trust_remote_code, include_special_tokens.
- NullTokenizer: no path (None); vocab_size (--vocab-size).
Values this backend cannot take differently (the flags it declines: --tokenizer-special-tokens,
--tokenizer-sentencepiece-legacy, --tokenizer-hf-no-include-special-tokens) are Megatron-LM's defaults.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

_TEXT_TOKENIZER = "megatron.core.tokenizers.text.models.default_tokenizer.DefaultTokenizerText"


def _identifiers(path: Optional[str], **kwargs) -> "OrderedDict[str, Optional[str]]":
    ids: "OrderedDict[str, Optional[str]]" = OrderedDict()
    ids["class"] = _TEXT_TOKENIZER
    ids["tokenizer_path"] = path
    for name, value in kwargs.items():
        ids[name] = str(value)
    return ids


def huggingface(path: str, use_fast: bool = True, trust_remote_code: bool = False) -> OrderedDict:
    return _identifiers(path, vocab_file=None, merges_file=None, additional_special_tokens=[], use_fast=use_fast,
                        trust_remote_code=trust_remote_code, include_special_tokens=True)


def sentencepiece(path: str) -> OrderedDict:
    return _identifiers(path, legacy=False, special_tokens=None)


def gpt2_bpe(vocab_file: str, merge_file: str) -> OrderedDict:
    return _identifiers("GPT2BPETokenizer", additional_special_tokens=[], vocab_file=vocab_file,
                        merges_file=merge_file, use_fast=True, trust_remote_code=False, include_special_tokens=True)


def null(vocab_size: int) -> OrderedDict:
    return _identifiers(None, vocab_size=vocab_size)
