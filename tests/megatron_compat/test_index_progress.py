"""Megatron's dataset-building progress lines: what is built, for which split and dataset, how many samples,
how long it took — printed once, by the rank that builds the caches."""
from __future__ import annotations

import contextlib
import io
import re

from megatron_compat.data.builder import BlendedMegatronDatasetBuilder
from megatron_compat.data.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron_compat.data.utils import get_blend_from_list, progress_lines
from tests.support.launchers import run_distributed
from tests.support.megatron_reference import IdsTokenizer, write_corpus

FLAGS = dict(reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)


def _build(prefixes, cache) -> str:
    """Builds a two-dataset blend inside `progress_lines`; returns what was printed."""
    blend = get_blend_from_list(["1", prefixes[0], "3", prefixes[1]])
    config = GPTDatasetConfig(random_seed=1, sequence_length=16, blend=blend, split="100,0,0",
                              path_to_cache=cache, tokenizer=IdsTokenizer(), **FLAGS)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), progress_lines(config.shared_storage):
        BlendedMegatronDatasetBuilder(GPTDataset, [300, 0, 0], lambda: True, config).build()
    return out.getvalue()


def test_build_then_load_lines(tmp_path):
    prefixes = [write_corpus(str(tmp_path / f"d{i}_text_document"), 50, seed=i) for i in range(2)]
    first = _build(prefixes, str(tmp_path / "cache"))
    lines = first.splitlines()
    assert lines[0] == "> building train, validation, and test datasets for GPT ..."
    assert lines[-1] == "> finished creating GPT datasets ..."
    for prefix in prefixes:
        assert f"Load the IndexedDataset from {prefix}.idx" in lines
    assert lines.count("Build and save the GPTDataset train indices") == 2
    assert lines.count("Build and save the BlendedDataset indices") == 1
    assert len(re.findall(r"^\t> time elapsed: \d+\.\d+ seconds$", first, re.M)) == 3
    assert len(re.findall(r"^> total number of samples: \d+$", first, re.M)) == 2
    assert len(re.findall(r"^> total number of epochs: \d+$", first, re.M)) == 2
    again = _build(prefixes, str(tmp_path / "cache")).splitlines()
    assert "Build and save" not in "\n".join(again)
    assert again.count("Load the GPTDataset train indices") == 2
    assert again.count("Load the BlendedDataset indices") == 1
    assert any(line.startswith("\tLoad the sample index from ") for line in again)


def _rank_output(rank, world_size, root):
    prefixes = [f"{root}/d{i}_text_document" for i in range(2)]
    with open(f"{root}/rank{rank}.txt", "w") as f:
        f.write(_build(prefixes, f"{root}/cache"))


def test_only_the_building_rank_prints(tmp_path):
    for i in range(2):
        write_corpus(str(tmp_path / f"d{i}_text_document"), 50, seed=i)
    run_distributed(_rank_output, 2, str(tmp_path))
    rank0 = (tmp_path / "rank0.txt").read_text()
    assert rank0.count("Build and save the GPTDataset train indices") == 2
    assert (tmp_path / "rank1.txt").read_text() == ""


def test_pretraining_data_shows_the_lines_and_checks_token_ids(tmp_path, capsys):
    """build_pretrain_data prints Megatron's lines (and the once-only token-id scan); ids beyond the run's
    vocabulary stop it with one line naming the file and the vocabulary size."""
    import pytest

    from fsdp2_backend.config import Config
    from fsdp2_backend.data.pretrain import build_pretrain_data
    from fsdp2_backend.usage_errors import UsageError

    prefix = write_corpus(str(tmp_path / "c" / "text_document"), 200, seed=3, vocab_size=1000)
    config = Config()
    config.data.cutoff_len = 16
    config.data.dataset = prefix
    config.data.split = "100,0,0"
    config.data.data_cache_path = str(tmp_path / "cache")
    build_pretrain_data(config, IdsTokenizer(vocab_size=1000), dp_rank=0, dp_size=1, consumed_samples=0,
                        global_batch_size=4, micro_batch_size=2, train_iters=5)
    out = capsys.readouterr().out
    assert out.startswith("> building train, validation, and test datasets for GPT ...\n")
    assert f"> checking the token ids of {prefix}.bin against the vocabulary (" in out
    assert "Build and save the GPTDataset train indices" in out
    assert out.endswith("> finished creating GPT datasets ...\n")
    with pytest.raises(UsageError) as info:
        build_pretrain_data(config, IdsTokenizer(vocab_size=900), dp_rank=0, dp_size=1, consumed_samples=0,
                            global_batch_size=4, micro_batch_size=2, train_iters=5)
    high = int(open(prefix + ".token_range").read().split()[-1])
    assert 900 <= high < 1000
    assert str(info.value) == (f"{prefix}.bin: token id {high} is outside the tokenizer's vocabulary (size 900) — "
                               "the data was tokenized with another tokenizer; preprocess it with this run's "
                               "tokenizer or train with the one it was made with")
    assert "checking the token ids" not in capsys.readouterr().out  # the range came from its cache
