"""HuggingFaceTokenizer loads the class AutoTokenizer would, without AutoTokenizer's torch import where the files
settle the choice (megatron_compat/data/hf_tokenizer_class.py). The reference is transformers' own
AutoTokenizer on the same directory: a byte-level BPE trained here and saved by transformers, with the
tokenizer_config.json class and the config.json model type set as model repositories ship them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdp2_backend.cli.demo_assets import stdlib_texts, train_bytelevel_tokenizer
from megatron_compat.data.hf_tokenizer_class import generic_backend_applies
from megatron_compat.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    train_bytelevel_tokenizer(path, vocab_size=400, texts=stdlib_texts(max_files=20))
    return path


def _variant(saved, tmp_path, tokenizer_class, model_type=None, auto_map=False):
    """The saved tokenizer with tokenizer_config.json's class (and a config.json of that model type)."""
    out = tmp_path / f"{tokenizer_class}-{model_type}-{auto_map}"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((saved / "tokenizer.json").read_bytes())
    config = json.loads((saved / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = tokenizer_class
    if auto_map:
        config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type:
        (out / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 400}))
    return out


# (tokenizer_config class, config.json model_type, whether the files alone settle it, AutoTokenizer's class in
# transformers 5.25)
CASES = [
    ("TokenizersBackend", None, True, "TokenizersBackend"),  # what transformers 5 saves
    ("PreTrainedTokenizerFast", None, True, "TokenizersBackend"),  # what transformers 4 saved
    ("PreTrainedTokenizerFast", "llama", True, "TokenizersBackend"),  # Llama-3's repositories
    ("TokenizersBackend", "qwen3", True, "TokenizersBackend"),
    # MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS: the model type's own class wins over the file's
    ("TokenizersBackend", "qwen2", False, "Qwen2Tokenizer"),
    ("PreTrainedTokenizerFast", "mistral", False, "TokenizersBackend"),  # MistralCommonBackend's type: asked
    ("Qwen2Tokenizer", "qwen2", False, "Qwen2Tokenizer"),  # a model-specific class
    ("GPT2Tokenizer", None, False, "GPT2Tokenizer"),
]


@pytest.mark.parametrize("tokenizer_class,model_type,direct,auto_class", CASES)
def test_same_class_and_ids_as_autotokenizer(saved, tmp_path, tokenizer_class, model_type, direct, auto_class):
    from transformers import AutoTokenizer

    path = _variant(saved, tmp_path, tokenizer_class, model_type)
    assert generic_backend_applies(str(path)) is direct
    reference = AutoTokenizer.from_pretrained(str(path))
    assert type(reference).__name__ == auto_class
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(path))
    assert type(ours.hf) is type(reference)
    text = stdlib_texts(max_files=25)[21]
    assert ours.tokenize(text) == reference.convert_tokens_to_ids(reference.tokenize(text))
    assert (ours.eod, ours.pad, ours.vocab_size) == (reference.eos_token_id, reference.pad_token_id, len(reference))


def test_custom_code_is_left_to_autotokenizer(saved, tmp_path):
    assert not generic_backend_applies(str(_variant(saved, tmp_path, "TokenizersBackend", auto_map=True)))


def test_no_torch_import(saved, tmp_path):
    """A preprocessing process's tokenizer load imports no torch (AutoTokenizer's config machinery does)."""
    code = ("import sys; from megatron_compat.data.tokenizer import build_tokenizer; "
            f"t = build_tokenizer('HuggingFaceTokenizer', tokenizer_model={str(saved)!r}); "
            "print(type(t.hf).__name__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["TokenizersBackend", "False"]
