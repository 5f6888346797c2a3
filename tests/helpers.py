"""Shared test helpers: tiny real models and tokenizers built locally, and a 2-rank gloo launcher.

Nothing here stands in for the code under test: models are real transformers models built from configs,
tokenizers are real byte-level BPE tokenizers trained on local text.
"""
from __future__ import annotations

import os
import socket
import sysconfig
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank, world_size, port, fn, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Runs `fn(rank, world_size, *args)` in `world_size` gloo processes; re-raises a failure.

    `fn` must be a module-level function (it is pickled). Results travel through files the caller names.
    """
    import torch.multiprocessing as mp

    mp.spawn(_spawn_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def tiny_qwen3_config(**overrides):
    """A Qwen3 config small enough to train on CPU in well under a second a step."""
    from transformers import Qwen3Config

    values = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    values.update(overrides)
    return Qwen3Config(**values)


def stdlib_texts(max_files: int = 200, max_chars: int = 4000) -> list[str]:
    """Real text that is on every machine: the sources of Python's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.glob("*.py"))[:max_files]:
        texts.append(path.read_text(encoding="utf-8", errors="replace")[:max_chars])
    return texts


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
