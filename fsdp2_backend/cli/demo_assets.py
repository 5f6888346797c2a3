#!/usr/bin/env python
"""Builds the demo's inputs from what is already on the machine: no download.

    python tools/demo_assets.py OUT_DIR [--vocab-size 2048] [--docs 3000]

Writes OUT_DIR/corpus.jsonl (Python standard-library sources, one file per JSON line), OUT_DIR/tokenizer (a
byte-level BPE trained on that corpus, saved as an HF tokenizer) and OUT_DIR/model (a tiny Qwen3 HF directory:
config and safetensors). The tests use the same functions.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path


def stdlib_texts(max_files: int = 200, max_chars: int = 4000) -> list[str]:
    """Real text on every machine: the sources of Python's standard library, in a stable order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(root.glob("*.py")) + sorted(root.glob("*/*.py"))
    return [p.read_text(encoding="utf-8", errors="replace")[:max_chars] for p in paths[:max_files]]


def train_bytelevel_tokenizer(out_dir, vocab_size: int = 512, texts=None):
    """Trains a byte-level BPE tokenizer on local text and saves it as an HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts if texts is not None else stdlib_texts()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(str(out_dir))
    return fast


def tiny_qwen3_config(**overrides):
    """A Qwen3 config small enough to train on CPU in well under a second a step."""
    from transformers import Qwen3Config

    values = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    values.update(overrides)
    return Qwen3Config(**values)


def write_jsonl_corpus(path, texts) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def build_tiny_model_dir(out_dir, vocab_size: int, seed: int = 0, **overrides) -> None:
    """Saves a randomly initialised tiny Qwen3 (config + safetensors) as an HF model directory."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=vocab_size, **overrides))
    model.save_pretrained(str(out_dir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=3000)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = stdlib_texts(max_files=args.docs)
    write_jsonl_corpus(out / "corpus.jsonl", texts)
    tokenizer = train_bytelevel_tokenizer(out / "tokenizer", vocab_size=args.vocab_size, texts=texts)
    build_tiny_model_dir(out / "model", vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384,
                         num_hidden_layers=4, head_dim=32, max_position_embeddings=1024)
    tokenizer.save_pretrained(str(out / "model"))
    print(f"demo assets in {out}: {len(texts)} documents, vocabulary {len(tokenizer)}")


if __name__ == "__main__":
    main()
