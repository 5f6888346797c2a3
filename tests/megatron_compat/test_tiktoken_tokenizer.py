"""Megatron's TikTokenizer: ids, special tokens, eod and cache identifiers equal megatron-core 0.16.1's
TikTokenTokenizer on the same JSON vocabulary (trained here with tiktoken's own BPE trainer); preprocessing
byte-identical to Megatron's algorithm with megatron-core's tokenizer; Megatron flags → training."""
from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys

import pytest

from megatron_compat.data.tiktoken_tokenizer import PATTERNS
from megatron_compat.data.tokenizer import build_tokenizer
from megatron_compat.translate import translate_megatron
from tests.support.launchers import run_pretrain
from tests.support.tiny_models import stdlib_texts
from tests.support.preprocess import PREPROCESS_TOOL, TOOL_ENV, assert_same_files, megatron_preprocess
from fsdp2_backend.usage_errors import UsageError

mcore_tok = pytest.importorskip("megatron.core.tokenizers.text.utils.build_tokenizer")
BPE_TOKENS = 340
SPECIAL_TEXT = "héllo wörld ✓ 日本語 </s> and <s>x<pad>"
TEXTS = stdlib_texts(12) + [SPECIAL_TEXT, "", "  \n\n\tTabs  and  CAPS  MixedCase 1234",
                            "<SPECIAL_9> <fim_prefix> 😀"]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """Megatron's JSON vocabulary of a byte-level BPE trained with tiktoken's own trainer on local text."""
    from tiktoken._educational import bpe_train

    # trained with the v1 regex, which keeps CamelCase words whole, so that merges across v2's splits exist
    corpus = "\n".join(stdlib_texts(40))[:12000] + " ValueError" * 40
    ranks = bpe_train(corpus, BPE_TOKENS, PATTERNS["v1"], visualise=None)
    entries = [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
                "token_str": token.decode("utf-8", errors="replace")}
               for token, rank in sorted(ranks.items(), key=lambda item: item[1])]
    path = tmp_path_factory.mktemp("tiktoken") / "vocab.json"
    path.write_text(json.dumps(entries))
    return str(path)


def _megatron(path, pattern=None, vocab_size=None, num_special=1000, special_tokens=None):
    ns = argparse.Namespace(tokenizer_type="TikTokenizer", tokenizer_model=path, tiktoken_pattern=pattern,
                            vocab_size=vocab_size, tiktoken_num_special_tokens=num_special,
                            tokenizer_special_tokens=special_tokens, tokenizer_metadata=None)
    return mcore_tok.build_tokenizer(ns)


CASES = [dict(pattern=None, num_special=1000), dict(pattern="v1", num_special=1000),
         dict(pattern="v2", num_special=20, special_tokens=["<pad>", "<unk>", "<s>", "</s>", "<mask>", "<cls>",
                                                             "<sep>", "<fim_prefix>", "<|im_end|>"])]


@pytest.mark.parametrize("case", CASES, ids=["default", "v1", "custom-specials"])
def test_ids_equal_megatron_core(vocab_file, case):
    vocab_size = case["num_special"] + BPE_TOKENS
    ref = _megatron(vocab_file, vocab_size=vocab_size, **case)
    ours = build_tokenizer("TikTokenizer", tokenizer_model=vocab_file, vocab_size=vocab_size,
                           tiktoken_pattern=case["pattern"], tiktoken_num_special_tokens=case["num_special"],
                           special_tokens=case.get("special_tokens"))
    for text in TEXTS:
        assert ours.tokenize(text) == ref.tokenize(text), text[:60]
    assert ours.tokenize_batch(TEXTS) == [ref.tokenize(t) for t in TEXTS]
    ids = ours.tokenize(SPECIAL_TEXT)
    assert any(i < case["num_special"] for i in ids)  # special tokens in text are special ids
    assert ours.detokenize(ids) == ref.detokenize(ids)
    assert (ours.eod, ours.bos, ours.pad, ours.vocab_size) == (ref.eod, ref.bos, ref.pad, ref.vocab_size)
    assert dict(ours.unique_identifiers) == dict(ref.unique_identifiers)


def test_v1_and_v2_split_differently(vocab_file):
    """The pattern choice matters on this text (so the parametrised equality above tests both regexes)."""
    text = "raise ValueError"
    v1, v2 = (build_tokenizer("TikTokenizer", tokenizer_model=vocab_file, vocab_size=1000 + BPE_TOKENS,
                              tiktoken_pattern=p).tokenize(text) for p in ("v1", "v2"))
    assert v1 != v2


def test_preprocess_byte_identical(vocab_file, tmp_path):
    lines = [json.dumps({"text": t}) for t in TEXTS]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    vocab_size = 1000 + BPE_TOKENS
    result = subprocess.run([sys.executable, str(PREPROCESS_TOOL), "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                             str(tmp_path / "ours"), "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                             vocab_file, "--tiktoken-pattern", "v1", "--vocab-size", str(vocab_size),
                             "--append-eod", "--workers", "2"], capture_output=True, text=True, env=TOOL_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    megatron_preprocess(lines, ["text"], _megatron(vocab_file, pattern="v1", vocab_size=vocab_size), True,
                        str(tmp_path / "ref"))
    assert_same_files(tmp_path / "ours", tmp_path / "ref", ["text"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(vocab_size=5000), "lower --vocab-size to 1340"),
    (dict(tiktoken_pattern="v3"), "--tiktoken-pattern: 'v3'"),
    (dict(special_tokens=["<s>", "</s>"]), "misses <unk> <mask> <pad> <cls> <sep>"),
    (dict(tiktoken_num_special_tokens=3), "--tiktoken-num-special-tokens: 3"),
])
def test_bad_settings_are_one_line(vocab_file, kwargs, message):
    kwargs = {"vocab_size": 1000 + BPE_TOKENS, **kwargs}
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        build_tokenizer("TikTokenizer", tokenizer_model=vocab_file, **kwargs)


def test_bad_vocabulary_file(tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps([{"rank": 0, "token_bytes": base64.b64encode(b"x").decode(), "token_str": "x"}]))
    with pytest.raises(UsageError, match="entry 0 is not the single byte 0"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(path), vocab_size=1001)
    with pytest.raises(UsageError, match="not a .json vocabulary"):
        build_tokenizer("TikTokenizer", tokenizer_model=str(tmp_path))
    with pytest.raises(UsageError, match="only read for --tokenizer-type TikTokenizer"):
        build_tokenizer("NullTokenizer", vocab_size=10, special_tokens=["<x>"])


TRAIN = ("--num-layers 1 --hidden-size 32 --num-attention-heads 4 --ffn-hidden-size 64 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --lr 1e-3 "
         "--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
         "--untie-embeddings-and-output-weights --log-interval 1 --eval-iters 0 --split 1,0,0 "
         "--tokenizer-type TikTokenizer --tiktoken-pattern v1 --make-vocab-size-divisible-by 128").split()


def test_flags_translate(vocab_file):
    fields = translate_megatron(TRAIN + ["--tokenizer-model", vocab_file, "--vocab-size", "1340",
                                         "--tiktoken-num-special-tokens", "900", "--tokenizer-special-tokens",
                                         "<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<eot>"]).fields
    model = fields["model"]
    assert (model["tokenizer_type"], model["tokenizer_model"], model["tiktoken_pattern"], model["vocab_size"],
            model["tiktoken_num_special_tokens"]) == ("TikTokenizer", vocab_file, "v1", 1340, 900)
    assert model["tokenizer_special_tokens"][-1] == "<eot>"
    with pytest.raises(UsageError, match="--tokenizer-special-tokens"):
        translate_megatron(TRAIN[:-6] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                         "--tokenizer-special-tokens", "<x>"])


def test_training_reads_tiktoken_data(vocab_file, tmp_path):
    """Data preprocessed with the TikTokenizer trains with the same tokenizer flags, here as fill-in-the-middle
    data (its FIM tokens are TikTokenizer special tokens); the model's embedding has Megatron's padded
    vocabulary (1340 → 1408, a multiple of 128)."""
    lines = [json.dumps({"text": t}) for t in stdlib_texts(20)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    common = ["--tokenizer-model", vocab_file, "--vocab-size", "1340", "--tokenizer-special-tokens", "<unk>",
              "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>",
              "<fim_pad>"]
    result = subprocess.run([sys.executable, str(PREPROCESS_TOOL), "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                             str(tmp_path / "data"), "--tokenizer-type", "TikTokenizer", "--tiktoken-pattern", "v1",
                             "--append-eod", *common], capture_output=True, text=True, env=TOOL_ENV)
    assert result.returncode == 0, result.stderr[-2000:]
    losses, _ = run_pretrain(TRAIN + common + ["--data-path", str(tmp_path / "data_text_document"),
                                               "--data-cache-path", str(tmp_path / "cache"), "--fim-data",
                                               "--fim-rate", "0.9", "--fim-eod-token", "</s>"], tmp_path / "run")
    assert sorted(losses) == [1, 2]
    assert list((tmp_path / "cache").glob("*-GPTFIMDataset-train-description.txt"))  # the FIM dataset was read
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert config["vocab_size"] == 1408
