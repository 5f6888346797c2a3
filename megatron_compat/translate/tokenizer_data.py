"""Megatron's TikTokenizer flags → model.tiktoken_* fields (the tokenizer: `megatron_compat.data.tiktoken_tokenizer`),
and Megatron-LM's fill-in-the-middle flags (`--fim-*`) → data.fim_* (the dataset: `megatron_compat.data.fim_dataset`).

`--tiktoken-pattern`, `--tiktoken-num-special-tokens` and `--tokenizer-special-tokens` are read by Megatron only
for `--tokenizer-type TikTokenizer`; with another type the first two have no effect, and special tokens (which
Megatron adds to HF / GPT-2 / SentencePiece tokenizers) are declined. The `--fim-*` settings have no effect
without `--fim-data`.
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import handles


def _tiktoken(ctx) -> bool:
    return ctx.get("tokenizer_type") == "TikTokenizer"


@handles("tiktoken_pattern", "model.tiktoken_pattern (TikTokenizer)")
def _pattern(ctx, value):
    if _tiktoken(ctx):
        ctx.set("model.tiktoken_pattern", value)
    else:
        ctx.record("tiktoken_pattern", "no_effect", "read only with --tokenizer-type TikTokenizer")


@handles("tiktoken_num_special_tokens", "model.tiktoken_num_special_tokens (TikTokenizer)")
def _num_special(ctx, value):
    if _tiktoken(ctx):
        ctx.set("model.tiktoken_num_special_tokens", value)
    else:
        ctx.record("tiktoken_num_special_tokens", "no_effect", "read only with --tokenizer-type TikTokenizer")


@handles("special_tokens", "model.tokenizer_special_tokens (TikTokenizer)")
def _special_tokens(ctx, value):
    if value is None:
        return
    if _tiktoken(ctx):
        ctx.set("model.tokenizer_special_tokens", list(value))
    else:
        ctx.decline("special_tokens", "adding special tokens to this tokenizer type is not implemented (only "
                                      "TikTokenizer's are read) — add them to the HF tokenizer directory")


# --- fill-in-the-middle data (Megatron-LM's GPTFIMDataset: megatron_compat.data.fim_dataset) -------------------
_FIM_FIELDS = ("fim_rate", "fim_spm_rate", "fim_split_sample", "fim_fragment_rate", "fim_no_prefix")
_FIM_TOKENS = ("prefix", "middle", "suffix", "pad", "eod")


@handles("fim_data", "data.fim_data (Megatron-LM's FIM dataset)")
def _fim_data(ctx, value):
    if value:
        ctx.set("data.fim_data", True)


def _fim_field(name):
    @handles(name, f"data.{name}")
    def handler(ctx, value):
        if ctx.get("fim_data"):
            ctx.set(f"data.{name}", value)
        else:
            ctx.record(name, "no_effect", "read only with --fim-data")


for _name in _FIM_FIELDS:
    _fim_field(_name)


def _fim_token(role):
    dest = f"fim_{role}_token"

    @handles(dest, f"data.fim_tokens[{role}]")
    def handler(ctx, value):
        if not ctx.get("fim_data"):
            ctx.record(dest, "no_effect", "read only with --fim-data")
            return
        if role == "prefix":  # the first token handler sets all five (each flag's value or Megatron's default)
            ctx.set("data.fim_tokens", {r: ctx.get(f"fim_{r}_token") for r in _FIM_TOKENS})


for _role in _FIM_TOKENS:
    _fim_token(_role)
