"""All problems at once, and --dry-run checks what it promises (issue 41): three bad values on the command line are
three lines; the global-batch divisibility error stays among tokenizer, data and warmup errors; a missing
--vocab-file / --merge-file, a wrong data prefix and a truncated .idx/.bin are found by validation (and by
--dry-run), before any model is built; a mistyped --load gets "did you mean iter_…"; a missing --tokenizer-model
is named as that flag."""
import os
import subprocess
import sys

import pytest

from fsdp2_backend.launch import parse_command_line
from fsdp2_backend.usage_errors import UsageError
from tests.support.launchers import ENTRY_ENV
from tests.support.launchers import REPO
from tests.support.megatron_reference import write_corpus

SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
         "--lr 1e-3 --train-iters 10").split()
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def _cli(*argv):
    result = subprocess.run([sys.executable, f"{REPO}/pretrain_fsdp2.py", *argv], capture_output=True, text=True,
                            env=ENTRY_ENV, cwd=REPO, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def _errors(argv):
    with pytest.raises(UsageError) as err:
        parse_command_line(argv, 1, check_files=True)
    return err.value.messages


def test_every_bad_value_on_the_command_line_is_reported():
    assert _cli(*SHAPE, *NULL, "--mock-data", "--micro-batch-size", "x", "--global-batch-size", "y",
                "--lr-decay-style", "cosin", "--eval-iters") == [
        "error: --micro-batch-size: invalid int value: 'x' — fix the value",
        "error: --global-batch-size: invalid int value: 'y' — fix the value",
        "error: --lr-decay-style: invalid choice: 'cosin' (choose from 'constant', 'linear', 'cosine', "
        "'inverse-square-root', 'WSD') — use one of the listed values",
        "error: --eval-iters: expected one argument — give it a value"]


def test_dry_run_reports_tokenizer_data_warmup_and_batch_problems_together(tmp_path):
    vocab = tmp_path / "gpt2-vocab.json"
    assert _cli(*SHAPE, "--micro-batch-size", "2", "--global-batch-size", "3", "--lr-warmup-iters", "20",
                "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--data-path",
                str(tmp_path / "corpus_text_document"), "--dry-run") == [
        f"error: --vocab-file: {vocab} not found (model.vocab_file, read by --tokenizer-type GPT2BPETokenizer) — "
        "check the path",
        "error: --merge-file: required by --tokenizer-type GPT2BPETokenizer (model.merge_file) — give the path",
        f"error: data.dataset (--data-path): {tmp_path}/corpus_text_document.bin/.idx not found — give the prefix of "
        "files written by preprocess_data.py, or a raw .jsonl/.jsonl.gz/.parquet file",
        "error: training.lr_warmup_iters (from --lr-warmup-iters): warmup (20 iterations) must be shorter than the "
        "decay (10 iterations) — shorten the warmup",
        "error: training.global_batch_size: 3 is not divisible by micro batch 2 x data-parallel size 1 — change "
        "--global-batch-size or --micro-batch-size"]


def test_a_truncated_pair_is_found_before_the_model_is_built(tmp_path):
    short_bin = write_corpus(str(tmp_path / "a" / "web_text_document"), 6, seed=3, vocab_size=128)
    short_idx = write_corpus(str(tmp_path / "b" / "web_text_document"), 6, seed=3, vocab_size=128)
    size = os.path.getsize(short_bin + ".bin")
    os.truncate(short_bin + ".bin", size - 2)  # a copy that stopped two bytes short
    os.truncate(short_idx + ".idx", os.path.getsize(short_idx + ".idx") - 8)
    base = SHAPE + NULL + ["--micro-batch-size", "1"]
    assert _errors(base + ["--data-path", short_bin]) == [
        f"data.dataset (--data-path): {short_bin}.bin: data file is {size - 2} bytes but its index needs {size} — "
        "the file is truncated; re-run preprocessing"]
    message, = _errors(base + ["--data-path", short_idx])
    assert message.startswith(f"data.dataset (--data-path): {short_idx}.idx: truncated index (")


def test_mistyped_load_and_missing_tokenizer_model_named_as_typed(tmp_path):
    (tmp_path / "ckpt" / "iter_0000030").mkdir(parents=True)
    typo = tmp_path / "ckpt" / "iter_0000300"
    base = SHAPE + NULL + ["--micro-batch-size", "1", "--mock-data"]
    message, = _errors(base + ["--load", str(typo)])
    assert message.startswith(f"model.model_name_or_path (from --load): {typo} not found; did you mean "
                              f"{tmp_path}/ckpt/iter_0000030? — ")
    missing = tmp_path / "tokenizer"
    message, = _errors(SHAPE + ["--micro-batch-size", "1", "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer",
                                "--tokenizer-model", str(missing)])
    assert message.startswith(f"model.tokenizer_name_or_path (from --tokenizer-type, --tokenizer-model): {missing} "
                              "not found — give an existing local Hugging Face tokenizer directory")
