"""The SFT pipeline's run-time options in one in-process rank: streaming really trains (an endless iterable over
epochs, no len()), a tokenized_path run and the run loading it train alike, and tools/preview_data.py shows the
trained spans and the ids."""
import json
import math
import os
import subprocess
import sys

import pytest

from fsdp2_backend.config import Config, DataArguments, ModelArguments, ParallelArguments, TrainingArguments
from fsdp2_backend.config.validation import validate
from tests.support.launchers import REPO
from tests.support.sft_assets import alpaca_rows, qwen3_model_dir, write_jsonl


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_pipeline")
    return {"model": qwen3_model_dir(root / "model"), "data": write_jsonl(root / "train.jsonl", alpaca_rows(10)),
            "root": root}


def _config(assets, **data):
    return validate(Config(
        model=ModelArguments(model_name_or_path=assets["model"]),
        data=DataArguments(dataset={"file_name": assets["data"], "formatting": "alpaca"}, template="qwen3",
                           cutoff_len=64, **data),
        training=TrainingArguments(stage="sft", max_steps=6, per_device_train_batch_size=2, lr=1e-3,
                                   save_checkpoints=False, warmup_ratio=0.0),
        parallel=ParallelArguments(param_dtype="fp32")))


def test_streaming_trains_past_an_epoch(assets):
    from fsdp2_backend.build import run_training

    result = run_training(_config(assets, streaming=True, buffer_size=4))
    # 10 samples, 2 per step: 6 steps run into the second epoch of the stream
    assert len(result.losses) == 6 and all(math.isfinite(x) for x in result.losses)


def test_tokenized_path_run_and_cached_run_train_alike(assets, tmp_path):
    from fsdp2_backend.build import run_training

    path = str(tmp_path / "tokenized")
    first = run_training(_config(assets, tokenized_path=path, packing=True))
    assert os.path.isfile(os.path.join(path, "sft_sets.json"))
    cached = run_training(_config(assets, tokenized_path=path, packing=True))
    assert cached.losses == pytest.approx(first.losses, rel=1e-6)


def test_preview_data_marks_trained_spans_and_prints_ids(assets, tmp_path):
    import yaml

    config = {"model": {"model_name_or_path": assets["model"]},
              "data": {"dataset": {"file_name": assets["data"], "formatting": "alpaca"}, "template": "qwen3",
                       "cutoff_len": 256},
              "training": {"stage": "sft", "max_steps": 1, "save_checkpoints": False, "disable_shuffling": True}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    tool = os.path.join(REPO, "tools", "preview_data.py")
    text = subprocess.run([sys.executable, tool, str(path), "--num", "2"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert text.returncode == 0, text.stderr[-2000:]
    first_output = alpaca_rows(10)[0]["output"]
    assert text.stdout.count("=== ") == 2
    assert f"[TRAIN]<think>\n\n</think>\n\n{first_output}<|im_end|>\n[/TRAIN]" in text.stdout
    assert text.stdout.startswith("=== 0 ===\n<|im_start|>user\n")
    ids = subprocess.run([sys.executable, tool, str(path), "--num", "1", "--json"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=300)
    row = json.loads(ids.stdout.splitlines()[0])
    assert len(row["input_ids"]) == len(row["labels"]) == row["doc_lens"][0]
    trained = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
    assert trained == [label for label in row["labels"] if label != -100] and trained
    bad = subprocess.run([sys.executable, tool, str(path), "--num", "x"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --num") and "Traceback" not in bad.stderr


def test_preview_json_prints_the_rows_training_consumes_in_its_order(assets, tmp_path, capsys):
    """tools/preview_data.py --json against the training loader itself (build_sft_data's micro-batches, shuffled):
    row n of the preview is sample n of the training stream, its ids and (shifted) labels."""
    import types

    import yaml

    from transformers import AutoTokenizer

    from fsdp2_backend.cli.preview_data import main
    from fsdp2_backend.data.sft.pipeline import build_sft_data

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"model_name_or_path": assets["model"]},
        "data": {"dataset": {"file_name": assets["data"], "formatting": "alpaca"}, "template": "qwen3",
                 "cutoff_len": 64, "tokenized_path": str(tmp_path / "tok")},
        "training": {"stage": "sft", "max_steps": 1, "save_checkpoints": False, "per_device_train_batch_size": 2}}))
    assert main([str(path), "--json", "--num", "10"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    config = _config(assets, tokenized_path=str(tmp_path / "tok"))
    hf = AutoTokenizer.from_pretrained(assets["model"])
    stream = build_sft_data(config, types.SimpleNamespace(hf=hf), 0, 1, 0).train_batches
    served = []
    for _ in range(5):
        batch = next(stream)
        for r in range(batch["tokens"].shape[0]):
            served.append((batch["tokens"][r], batch["labels"][r], batch["loss_mask"][r]))
    assert len(rows) == 10
    assert [row["input_ids"] for row in rows] != [r["input_ids"] for r in _unshuffled(config, hf)]  # shuffled
    for row, (tokens, labels, mask) in zip(rows, served):
        n = len(row["input_ids"])
        assert tokens[:n].tolist() == row["input_ids"]
        trained = [label != -100 for label in row["labels"][1:]]
        assert mask[:n - 1].bool().tolist() == trained
        assert [t for t, keep in zip(labels[:n - 1].tolist(), trained) if keep] == \
            [label for label in row["labels"][1:] if label != -100]


def _unshuffled(config, hf):
    from fsdp2_backend.data.sft.pipeline import prepare_datasets

    return list(prepare_datasets(config, hf)["train"])

