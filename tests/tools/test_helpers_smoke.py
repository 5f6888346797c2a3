"""The shared helpers build a real tokenizer and a real model that run together."""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.tiny_models import tiny_qwen3_config, train_bytelevel_tokenizer


def test_tiny_tokenizer_and_model_run(tmp_path):
    train_bytelevel_tokenizer(tmp_path / "tok", vocab_size=400)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    ids = tok("def f(x):\n    return x + 1\n")["input_ids"]
    assert tok.decode(ids) == "def f(x):\n    return x + 1\n"
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(vocab_size=len(tok)))
    out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    assert torch.isfinite(out.loss)
