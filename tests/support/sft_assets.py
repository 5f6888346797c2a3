"""Test assets of the SFT tests: a locally trained tokenizer shaped like Qwen3's (byte-level BPE with Qwen's
pre-tokenizer split, its special and added tokens, its chat template from tests/data/sft) and small datasets."""
from __future__ import annotations

import json
import os

from fsdp2_backend.cli.demo_assets import build_tiny_model_dir, stdlib_texts

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
QWEN3_TEMPLATE = os.path.join(HERE, "data", "sft", "qwen3_chat_template.jinja")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


def qwen3_like_tokenizer(out_dir, vocab_size: int = 400):
    """An HF fast tokenizer with Qwen3's pre-tokenization, special tokens and chat template, trained on local
    text (eos <|im_end|> and pad <|endoftext|>, as Qwen3's instruct tokenizer)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = stdlib_texts(max_files=60, max_chars=3000) + ["hello world, what is the weather in Paris today?"] * 5
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED])
    with open(QWEN3_TEMPLATE, encoding="utf-8") as f:
        template = f.read()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=template)
    fast.save_pretrained(str(out_dir))
    return fast


def qwen3_model_dir(path, seed: int = 0) -> str:
    """A tiny seeded Qwen3 with the Qwen3-like tokenizer (an HF directory)."""
    tokenizer = qwen3_like_tokenizer(path)
    build_tiny_model_dir(path, vocab_size=len(tokenizer), seed=seed)
    return str(path)


def alpaca_rows(count: int, seed: int = 0):
    """Alpaca rows of varied lengths drawn from local text."""
    import random

    rng = random.Random(seed)
    words = " ".join(stdlib_texts(max_files=20, max_chars=2000)).split()
    def phrase(n):
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start:start + n])
    return [{"instruction": phrase(rng.randint(3, 12)), "input": phrase(rng.randint(0, 6)) if i % 3 else "",
             "output": phrase(rng.randint(4, 20))} for i in range(count)]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return str(path)
