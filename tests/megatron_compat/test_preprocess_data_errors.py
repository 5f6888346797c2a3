"""tools/preprocess_data.py on bad input: one clear line, exit 2, nothing that looks complete left behind; a
dying worker ends the run (the parity tests with Megatron's tool are in test_preprocess_data.py)."""
from __future__ import annotations

import json
import os
from concurrent.futures.process import BrokenProcessPool

import pytest

from megatron_compat.data.preprocess import output_prefix_for, preprocess_files
from megatron_compat.data.tokenizer import build_tokenizer
from tests.support.preprocess import run_preprocess_tool
from tests.support.preprocess import corpus, hf_dir  # noqa: F401  (pytest fixtures)
from fsdp2_backend.usage_errors import UsageError


def _bad_run(tmp_path, hf_dir, content, *extra):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    result = run_preprocess_tool("--input", path, "--output-prefix", tmp_path / "out", "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--workers", 2, *extra)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]
    return result.stderr


def test_malformed_json_line_names_file_and_line(tmp_path, hf_dir):
    good = json.dumps({"text": "hello"}) + "\n"
    stderr = _bad_run(tmp_path, hf_dir, good * 3000 + '{"text": "broken\n' + good)
    assert f"error: {tmp_path / 'bad.jsonl'} line 3001: invalid JSON" in stderr


def test_missing_key_names_key_and_line(tmp_path, hf_dir):
    stderr = _bad_run(tmp_path, hf_dir, '{"text": "a"}\n{"body": "b"}\n')
    assert "line 2: key 'text' missing (the record has: body) — check --json-keys" in stderr


def test_missing_tokenizer_names_path(tmp_path):
    result = run_preprocess_tool("--input", tmp_path / "x.jsonl", "--output-prefix", tmp_path / "o", "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", tmp_path / "nope")
    assert result.returncode == 2 and f"error: --tokenizer-model: tokenizer {tmp_path / 'nope'} not found" \
        in result.stderr


def test_missing_input_and_split_sentences_without_nltk(tmp_path, hf_dir):
    stderr = _bad_run(tmp_path, hf_dir, "", "--input", str(tmp_path / "none*.jsonl"))
    assert "error: --input: " in stderr and "no such file" in stderr
    stderr = _bad_run(tmp_path, hf_dir, '{"text": "a. b."}\n', "--split-sentences", "--lang", "klingon")
    assert ("error: --split-sentences: needs NLTK, which is not installed" in stderr
            or "error: --lang klingon: NLTK punkt data not found" in stderr)


class _DyingTokenizer:
    """A real tokenizer whose process exits on one poisoned text, as an OOM-killed worker would."""

    def __init__(self, inner):
        self.inner, self.eod, self.vocab_size, self.tokenizer_type = inner, inner.eod, inner.vocab_size, "x"

    def tokenize_batch(self, texts):
        if "POISON" in texts:
            os._exit(1)
        return self.inner.tokenize_batch(texts)


def test_dying_worker_ends_the_run(tmp_path, hf_dir):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": "POISON" if i == 40 else f"doc {i}"}) + "\n" for i in range(80)))
    tokenizer = _DyingTokenizer(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir))
    with pytest.raises(BrokenProcessPool):
        preprocess_files(str(path), str(tmp_path / "o"), ["text"], tokenizer, workers=2, batch_docs=4)
    assert not list(tmp_path.glob("o_*"))


def test_usage_checks(tmp_path, hf_dir, corpus):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    with pytest.raises(UsageError) as info:
        preprocess_files(str(corpus[0]), str(tmp_path / "o"), [], tokenizer, workers=3, partitions=2,
                         log_interval=0)
    assert len(info.value.messages) == 3
    assert output_prefix_for("p", "text", True) == "p_text_sentence"


@pytest.mark.parametrize("content", ["", "\n\n"])
def test_empty_input_is_refused_in_one_line(tmp_path, hf_dir, content):
    """Megatron writes an empty dataset and exits 0; the tool refuses and writes nothing."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(content)
    result = run_preprocess_tool("--input", empty, "--output-prefix", tmp_path / "out", "--tokenizer-type",
                       "HuggingFaceTokenizer", "--tokenizer-model", hf_dir)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [  # Megatron's "Opening" line, then the one-line error
        f"Opening {empty}",
        f"error: --input: {empty}: no records to tokenize (empty input) — nothing was written; check the input file"]
    assert not list(tmp_path.glob("out*"))


def test_invalid_json_says_at_once():
    """json's "Invalid control character at" message ends in "at": the column follows it once."""
    from fsdp2_backend.usage_errors import UsageError
    from megatron_compat.data.preprocess_worker import parse_line

    with pytest.raises(UsageError) as err:
        parse_line('{"text": "a\tb"}', "corpus.jsonl line 7")
    assert err.value.messages == ["corpus.jsonl line 7: invalid JSON (Invalid control character at column 12) — fix "
                                  "or remove the line"]
