"""Test assets of the SFT tests: a locally trained tokenizer shaped like Qwen3's (byte-level BPE with Qwen's
pre-tokenizer split, its special and added tokens, its chat template from tests/data/sft) and small datasets."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from fsdp2_backend.cli.demo_assets import build_tiny_model_dir, stdlib_texts
from tests.support.launchers import MEGATRON_LINE, REPO, torchrun_command

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


RTOL = 1e-5


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_train")
    model = qwen3_model_dir(root / "model", seed=0)
    write_jsonl(root / "a.jsonl", alpaca_rows(24, seed=1))
    write_jsonl(root / "b.jsonl", alpaca_rows(12, seed=2))
    (root / "dataset_info.json").write_text(json.dumps({"set_a": {"file_name": "a.jsonl"},
                                                        "set_b": {"file_name": "b.jsonl", "formatting": "alpaca"}}))
    return {"root": root, "model": model}


def sft_yaml(assets, name, data=None, training=None, parallel=None):
    config = {"model": {"model_name_or_path": assets["model"]},
              "data": {"dataset": "set_a,set_b", "dataset_dir": str(assets["root"]), "template": "qwen3",
                       "cutoff_len": 96, **(data or {})},
              "training": {"stage": "sft", "max_steps": 4, "lr": 1e-3, "min_lr": 1e-4, "warmup_ratio": 0.0,
                           "logging_steps": 1, "save_steps": 0, **(training or {})},
              "parallel": {"param_dtype": "fp32", **(parallel or {})}}
    path = assets["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def run_sft(yaml_path, output_dir, ranks=1):
    """pretrain_fsdp2.py YAML --training.output_dir OUT (under torchrun when ranks > 1): ({iteration: (consumed,
    printed loss)}, log). Native fields only: a Megatron flag such as --save would select the pretraining stage."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    entry = [os.path.join(REPO, "pretrain_fsdp2.py"), yaml_path, "--training.output_dir", str(output_dir)]
    if ranks == 1:
        env.pop("WORLD_SIZE", None)
        command = [sys.executable, *entry]
    else:
        command = torchrun_command(ranks, *entry)
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    return {int(it): (int(c), loss) for it, c, loss in MEGATRON_LINE.findall(log)}, log


def sft_losses(lines):
    return {it: float(loss) for it, (_, loss) in lines.items()}


def losses_close(a, b):
    assert a.keys() == b.keys() and a, (a, b)
    for key in a:
        assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (key, a[key], b[key])
