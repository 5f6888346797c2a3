"""The tokenizer of a run, the tokens it adds, and the vocabulary size the model gets from it.

- One tokenizer type for the whole engine: megatron_compat's (see `load_tokenizer`). `model.tokenizer_type`
  set: Megatron's tokenizer of that type; otherwise the HF `AutoTokenizer` of `tokenizer_name_or_path`
  (default: `model_name_or_path`) with `use_fast_tokenizer`, `split_special_tokens`, `trust_remote_code`,
  `cache_dir`, `model_revision`, wrapped.
- `add_tokens` / `add_special_tokens` (comma-separated) extend an HF tokenizer.
- `model_vocab_size` decides the embedding rows: the checkpoint's, grown to the tokenizer with
  `resize_vocab`; from scratch, the tokenizer's padded like Megatron (`make_vocab_size_divisible_by` x TP, the
  multiple taken once, here).
- New rows (a resized vocabulary) are `noise_init`: the mean of the existing rows plus Gaussian noise of
  std 1/sqrt(hidden). `new_special_tokens_config` (a YAML {token: description}) adds its tokens as special tokens
  (instead of `add_special_tokens`); with `init_special_tokens` desc_init a new token's row (embedding and lm
  head alike) is the mean of the existing rows of its description's tokens, desc_init_w_noise adds the same
  Gaussian noise (LLaMA-Factory's semantics). Only rows the resize creates are written: a described token that
  already has a row in the checkpoint keeps it.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from fsdp2_backend.config import ModelArguments
from fsdp2_backend.usage_errors import UsageError


def _split(tokens: Optional[str]) -> list:
    return [t.strip() for t in (tokens or "").split(",") if t.strip()]


def load_tokenizer(model_args: ModelArguments):
    """The run's tokenizer, always one type: megatron_compat's tokenizer surface (`eod`, `vocab_size`, `pad`,
    `tokenize`, `detokenize`, and `hf`, the transformers tokenizer inside, None for SentencePiece / Null).

    `tokenizer_type` set: Megatron's tokenizer of that type. Unset: the HF tokenizer of `tokenizer_name_or_path`
    (default `model_name_or_path`) read as MindSpeed's PretrainedFromHF (special tokens kept when tokenizing).
    Added tokens (`add_tokens`, `add_special_tokens`) are counted in `vocab_size`.
    """
    from megatron_compat.data.tokenizer import HuggingFaceTokenizer, build_tokenizer

    if model_args.tokenizer_type:
        tokenizer = build_tokenizer(model_args.tokenizer_type, tokenizer_model=model_args.tokenizer_model,
                                    tokenizer_name_or_path=model_args.tokenizer_name_or_path,
                                    vocab_file=model_args.vocab_file, merge_file=model_args.merge_file,
                                    vocab_size=model_args.vocab_size, trust_remote_code=model_args.trust_remote_code,
                                    use_fast=model_args.use_fast_tokenizer,
                                    tiktoken_pattern=model_args.tiktoken_pattern,
                                    tiktoken_num_special_tokens=model_args.tiktoken_num_special_tokens,
                                    special_tokens=model_args.tokenizer_special_tokens)
    else:
        tokenizer = HuggingFaceTokenizer.from_hf(_load_hf_tokenizer(model_args))
    hf = getattr(tokenizer, "hf", None)
    descriptions = special_token_descriptions(model_args)
    if descriptions:
        if hf is None:
            raise UsageError(f"model.new_special_tokens_config: the {model_args.tokenizer_type} tokenizer cannot "
                             f"take new tokens — use an HF tokenizer")
        hf.add_tokens(_split(model_args.add_tokens))
        hf.add_special_tokens({"additional_special_tokens": list(descriptions)}, replace_extra_special_tokens=False)
        tokenizer.vocab_size = len(hf)
    elif model_args.add_tokens or model_args.add_special_tokens:
        if hf is None:
            raise UsageError(f"model.add_tokens / add_special_tokens: the {model_args.tokenizer_type} tokenizer "
                             f"cannot take new tokens — use an HF tokenizer")
        hf.add_tokens(_split(model_args.add_tokens))
        hf.add_special_tokens({"additional_special_tokens": _split(model_args.add_special_tokens)},
                              replace_extra_special_tokens=False)
        tokenizer.vocab_size = len(hf)
    return tokenizer


def _load_hf_tokenizer(model_args: ModelArguments):
    from transformers import AutoTokenizer

    path = model_args.tokenizer_name_or_path or model_args.model_name_or_path
    if not path:
        raise UsageError("model.tokenizer_name_or_path (--tokenizer-name-or-path): no tokenizer given — name a "
                         "tokenizer directory or a --tokenizer-type")
    try:
        return AutoTokenizer.from_pretrained(path, use_fast=model_args.use_fast_tokenizer,
                                             split_special_tokens=model_args.split_special_tokens,
                                             trust_remote_code=model_args.trust_remote_code,
                                             cache_dir=model_args.cache_dir, revision=model_args.model_revision,
                                             token=model_args.hf_hub_token)
    except (OSError, ValueError) as exc:
        raise UsageError(f"model.tokenizer_name_or_path: cannot load a tokenizer from {path} "
                         f"({str(exc).splitlines()[0]}) — give a local HF tokenizer directory")


def tokenizer_size(tokenizer) -> int:
    """Token ids the tokenizer can produce (added tokens included)."""
    return int(tokenizer.vocab_size)


def padded_vocab_size(size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: up to a multiple of make_vocab_size_divisible_by x tensor-parallel size."""
    multiple = max(divisible_by, 1) * max(tp_size, 1)
    return int(math.ceil(size / multiple) * multiple)


def model_vocab_size(model_args: ModelArguments, config_vocab: Optional[int], tokenizer, *, from_checkpoint: bool,
                     tp_size: int = 1) -> int:
    """Embedding rows for the model: see the module docstring. A tokenizer larger than a checkpoint's
    vocabulary without `resize_vocab` is a usage error (its ids would index past the embedding)."""
    tokens = tokenizer_size(tokenizer)
    if not from_checkpoint:
        return padded_vocab_size(max(config_vocab or 0, tokens), model_args.make_vocab_size_divisible_by, tp_size)
    if tokens <= config_vocab:
        return config_vocab
    if not model_args.resize_vocab:
        raise UsageError(f"model.resize_vocab: the tokenizer has {tokens} tokens but the checkpoint's vocabulary "
                         f"has {config_vocab} rows — set resize_vocab to grow the embedding and lm_head")
    return padded_vocab_size(tokens, model_args.make_vocab_size_divisible_by, tp_size)


def noise_init_rows(seed: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """`new_rows(old, n)`: n rows = mean of `old`'s rows + N(0, 1/hidden) noise, from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)

    def new_rows(old: torch.Tensor, count: int) -> torch.Tensor:
        mean = old.float().mean(dim=0, keepdim=True)
        noise = torch.randn(count, old.shape[1], generator=generator) / math.sqrt(old.shape[1])
        return (mean + noise).to(old.dtype)

    return new_rows


def special_token_descriptions(model_args: ModelArguments) -> dict:
    """{token: description} of `new_special_tokens_config` ({} when unset); validation checked the file."""
    if not model_args.new_special_tokens_config:
        return {}
    import yaml

    with open(model_args.new_special_tokens_config, encoding="utf-8") as f:
        return {str(k): str(v) for k, v in (yaml.safe_load(f) or {}).items()}


def new_token_rows(model_args: ModelArguments, tokenizer, seed: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """`new_rows(old, n)` for a resized embedding / lm head by `init_special_tokens` (see the module docstring)."""
    noise = noise_init_rows(seed)
    descriptions = special_token_descriptions(model_args)
    if model_args.init_special_tokens == "noise_init" or not descriptions:
        return noise
    hf = tokenizer.hf
    with_noise = model_args.init_special_tokens == "desc_init_w_noise"
    generator = torch.Generator().manual_seed(seed + 1)
    described = {hf.convert_tokens_to_ids(token): text for token, text in descriptions.items()}

    def new_rows(old: torch.Tensor, count: int) -> torch.Tensor:
        rows = noise(old, count).float()
        first = old.shape[0]
        for token_id, text in described.items():
            if token_id is None or not first <= token_id < first + count:
                continue  # a row the checkpoint already has
            ids = [i for i in hf(text, add_special_tokens=False)["input_ids"] if i < first]
            base = old[ids].float().mean(dim=0) if ids else old.float().mean(dim=0)
            if with_noise:
                base = base + torch.randn(old.shape[1], generator=generator) / math.sqrt(old.shape[1])
            rows[token_id - first] = base
        return rows.to(old.dtype)

    return new_rows
