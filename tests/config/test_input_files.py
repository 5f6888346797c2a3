"""A newcomer's wrong inputs, found before anything is loaded (config/rules/input_files.py through the command line): a
blend with an odd number of entries, a .bin named instead of its prefix, a prefix that is not there ("did you
mean" among the files beside it), a missing --load directory — all in one report — and a read-only data folder
(the index caches, a raw file's tokenized copy), named with the field that moves the writes. Also the Megatron
translation facts a newcomer meets: GPT-2-style flags checked against a loaded Qwen3, the --dry-run header."""
from __future__ import annotations

import re

import pytest
import yaml

from fsdp2_backend.launch import main, parse_command_line
from fsdp2_backend.usage_errors import UsageError
from tests.support.disk import read_only_dir
from tests.support.tiny_models import tiny_model_dir

SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
         "--micro-batch-size 1 --global-batch-size 1 --train-iters 3 --lr 1e-3").split()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 HF directory: 4 heads, 2 key/value heads of width 16."""
    return tiny_model_dir(tmp_path_factory.mktemp("qwen3"), seed=0)


def _prefix(folder, name):
    """A small .bin/.idx pair written by megatron-core's builder."""
    from tests.support.megatron_reference import write_corpus

    return write_corpus(str(folder / name), 4, seed=0, vocab_size=128)


def _errors(argv):
    with pytest.raises(UsageError) as err:
        parse_command_line(argv, 1, check_files=True)
    return err.value.messages


def test_wrong_data_and_model_paths_reported_at_once(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    real = _prefix(data, "corpus_text_document")
    _prefix(data, "other_text_document")
    missing_model = str(tmp_path / "no_such_model")
    base = SHAPE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    messages = _errors(base + ["--load", missing_model, "--data-path", "0.5", f"{data}/corpus_text", "0.5",
                               f"{real}.bin"])
    assert messages == [
        f"model.model_name_or_path (from --load): {missing_model} not found — give an existing local Hugging Face "
        f"model directory (config.json, tokenizer files, safetensors) or a checkpoint",
        f"data.dataset (--data-path): {data}/corpus_text.bin/.idx not found; did you mean {real}? — give the "
        f"prefix of files written by preprocess_data.py, or a raw .jsonl/.jsonl.gz/.parquet file",
        f"data.dataset (--data-path): {real}.bin names one file of the indexed pair — give its prefix {real} "
        f"(without .bin/.idx), as Megatron's --data-path takes it",
    ]
    assert _errors(base + ["--data-path", "0.7", real, "0.3"]) == [
        f"data.dataset (--data-path): an odd number of blend entries (3: 0.7 {real} 0.3) — give weight and prefix "
        f"pairs: W1 PREFIX1 W2 PREFIX2 ..."]
    # without check_files (a caller that only translates) the files are not looked at
    parse_command_line(base + ["--data-path", f"{data}/corpus_text"], 1)


def test_read_only_data_folder_names_the_field_to_set(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    prefix = _prefix(data, "corpus_text_document")
    (data / "chat.jsonl").write_text('{"text": "a"}\n')
    base = SHAPE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    with read_only_dir(data):
        messages = _errors(base + ["--data-path", prefix, str(data / "chat.jsonl")])
        assert messages == [
            f"data.data_cache_path (--data-cache-path): the dataset index caches of {prefix} go to {prefix}/cache/"
            f"GPTDataset_indices by default, and {data} is not writable — set --data-cache-path "
            f"(data.data_cache_path) to a folder you can write to",
            f"data.tokenized_path: {data}/chat.jsonl is tokenized into {data}/chat_tokenized, and {data} is not "
            f"writable — set data.tokenized_path (--data.tokenized_path) to a folder you can write to",
        ]
        # the fields named move the writes: accepted
        parse_command_line(base + ["--data-path", prefix, str(data / "chat.jsonl"), "--data-cache-path",
                                   str(tmp_path / "cache"), "--data.tokenized_path", str(tmp_path / "tok")],
                           1, check_files=True)


def test_gpt2_style_flags_over_a_loaded_qwen3_are_checked_and_named_as_qwen3(qwen3_dir):
    """No --swiglu / RMSNorm / rope: GPT-2's style, but --load defines a Qwen3 — its key/value heads (2) and head
    width (16) are checked as with Llama-style flags, and the dry run names the keys as Qwen3's config does."""
    gpt2_style = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                  "--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
                  "--load", qwen3_dir]
    with pytest.raises(UsageError) as err:
        parse_command_line(gpt2_style + ["--group-query-attention", "--num-query-groups", "1", "--kv-channels", "32"], 1)
    assert err.value.messages == [
        f"model.architecture.num_key_value_heads (from --group-query-attention, --num-query-groups): the flags say "
        f"1 but {qwen3_dir} config.json says 2 — fix the flag, or drop the architecture flags (the model is defined "
        f"there)",
        f"model.architecture.head_dim (from --kv-channels): the flags say 32 but {qwen3_dir} config.json says 16 — "
        f"fix the flag, or "
        f"drop the architecture flags (the model is defined there)"]
    config, _ = parse_command_line(gpt2_style, 1)
    assert config.model.architecture == {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}


def test_dry_run_header_names_its_world_size(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(SHAPE + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
                         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                         "--disable-bias-linear", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("# pretrain_fsdp2.py --dry-run for WORLD_SIZE=1: this file runs as it is at that "
                                   "world size only (the batch split and the layout were derived for it) — for "
                                   "another, rerun --dry-run with that WORLD_SIZE")
    assert yaml.safe_load(out)["training"]["max_steps"] == 3
    # what the command sets comes first (commented: the output still loads as the full config)
    lines = out.splitlines()
    assert re.fullmatch(r"# the (\d+) fields \(of (\d+)\) not at their default; the full config, every default "
                        r"filled in, follows:", lines[1])
    head = lines[2:lines.index("model:")]
    assert all(line.startswith("#   ") for line in head) and "#     max_steps: 3" in head
    assert "#     tp_size: 1" not in head and "  tp_size: 1" in lines  # a default: in the full config only
    assert "  exit_signal: SIGTERM" in lines  # Megatron's default signal.SIGTERM by name (was '15', and listed)
    assert yaml.safe_load("\n".join(line[4:] for line in head))["training"]["lr"] == 1e-3


def test_blend_weight_of_zero_or_below_is_refused_before_anything_loads(tmp_path):
    """Megatron's rule (megatron-core 0.16.1 BlendedDataset asserts every weight > 0): checked with the other blend
    rules, in the process the user runs, before any model or index is built (was a 121-line traceback after)."""
    import subprocess
    import sys

    from tests.support.launchers import ENTRY_ENV
    from tests.support.launchers import REPO

    data = tmp_path / "data"
    data.mkdir()
    web, books, code = (_prefix(data, n) for n in ("web_text_document", "books_text_document", "code_text_document"))
    argv = SHAPE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--data-path", "0.7", web, "0",
                    books, "-0.5", code]
    result = subprocess.run([sys.executable, f"{REPO}/pretrain_fsdp2.py", *argv], capture_output=True, text=True,
                            env=ENTRY_ENV, cwd=REPO, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: data.dataset (--data-path): weight {w} for {p} — Megatron blends take positive weights only "
        f"(megatron-core's BlendedDataset); leave the dataset out of the list to switch it off"
        for w, p in (("0", books), ("-0.5", code))]
    # the per-split blends follow the same rule
    assert _errors(SHAPE + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--train-data-path", "1",
                            web, "0.0", books, "--valid-data-path", web, "--test-data-path", web]) == [
        f"data.train_data_path (--train-data-path): weight 0.0 for {books} — Megatron blends take positive weights "
        f"only (megatron-core's BlendedDataset); leave the dataset out of the list to switch it off"]
