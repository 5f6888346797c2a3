"""SFT data that cannot train (issue 41): rows with no text in the prompt or the reply their `formatting` names are
malformed; a dataset of mostly malformed rows (a sharegpt file registered as alpaca), an empty file and a file whose
rows are all dropped end in one `error:` line naming the file — in tools/preview_data.py and in training, exit code
2, no traceback."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from fsdp2_backend.data.sft.formats import DatasetAttr, convert_example
from tests.support.launchers import REPO
from tests.support.sft_assets import alpaca_rows, qwen3_model_dir, write_jsonl

SHAREGPT_ROW = {"conversations": [{"from": "human", "value": "What is 2+3?"}, {"from": "gpt", "value": "5"}]}
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
ENV.pop("WORLD_SIZE", None)


def test_rows_without_prompt_or_reply_text_are_malformed():
    alpaca = DatasetAttr(name="a", file_name="-", formatting="alpaca")
    assert convert_example(SHAREGPT_ROW, alpaca) is None  # neither instruction nor output
    assert convert_example({"instruction": "Sum 2 and 3", "output": "  "}, alpaca) is None
    assert convert_example({"instruction": "", "input": "", "output": "5"}, alpaca) is None
    assert convert_example({"instruction": "", "input": "2 and 3", "output": "5"}, alpaca)["messages"] == [
        {"role": "user", "content": "2 and 3"}, {"role": "assistant", "content": "5"}]
    sharegpt = DatasetAttr(name="s", file_name="-", formatting="sharegpt")
    empty_reply = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]}
    assert convert_example(empty_reply, sharegpt) is None
    openai = DatasetAttr(name="o", file_name="-", formatting="openai")
    assert convert_example(SHAREGPT_ROW, openai) is None  # no 'messages' column


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_sft")
    write_jsonl(root / "chat.jsonl", [SHAREGPT_ROW] * 9 + [alpaca_rows(1)[0]])
    (root / "empty.jsonl").write_text("\n")
    out_of_turn = {"conversations": list(reversed(SHAREGPT_ROW["conversations"]))}
    write_jsonl(root / "turns.jsonl", [out_of_turn] * 8)
    (root / "dataset_info.json").write_text(json.dumps({
        "chat": {"file_name": "chat.jsonl", "formatting": "alpaca"}, "empty": {"file_name": "empty.jsonl"},
        "turns": {"file_name": "turns.jsonl", "formatting": "sharegpt"}}))
    return {"root": root, "model": qwen3_model_dir(root / "model")}


def _yaml(assets, dataset):
    config = {"model": {"model_name_or_path": assets["model"]},
              "data": {"dataset": dataset, "dataset_dir": str(assets["root"]), "template": "qwen3", "cutoff_len": 64},
              "training": {"stage": "sft", "max_steps": 2, "lr": 1e-3, "save_checkpoints": False}}
    path = assets["root"] / f"{dataset}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _errors(result):
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def _preview(assets, dataset):
    tool = os.path.join(REPO, "tools", "preview_data.py")
    return subprocess.run([sys.executable, tool, _yaml(assets, dataset), "--num", "1"], capture_output=True,
                          text=True, env=ENV, cwd=REPO, timeout=300)


def test_preview_refuses_a_sharegpt_file_registered_as_alpaca(assets):
    chat = os.path.join(str(assets["root"]), "chat.jsonl")
    assert _errors(_preview(assets, "chat")) == [
        f"error: data.dataset: {chat} (dataset 'chat'): 9 of 10 rows are not alpaca conversations — formatting "
        "alpaca reads 'instruction/input' (prompt) and 'output' (reply), the file has columns ['conversations', "
        "'instruction', 'input', 'output']; its columns look like sharegpt: set formatting: sharegpt in "
        "dataset_info.json or the inline entry"]


def test_preview_of_an_empty_file(assets):
    empty = os.path.join(str(assets["root"]), "empty.jsonl")
    assert _errors(_preview(assets, "empty")) == [
        f"error: data.dataset: {empty} (dataset 'empty') has no rows — give a file with alpaca rows, or remove it "
        "from the list"]


def test_training_on_rows_all_dropped(assets, tmp_path):
    entry = os.path.join(REPO, "pretrain_fsdp2.py")
    result = subprocess.run([sys.executable, entry, _yaml(assets, "turns"), "--training.save_checkpoints", "true",
                             "--training.output_dir", str(tmp_path / "out")], capture_output=True, text=True, env=ENV,
                            cwd=REPO, timeout=300)
    turns = os.path.join(str(assets["root"]), "turns.jsonl")
    errors = _errors(result)
    assert len(errors) == 1 and errors[0].startswith(
        f"error: data.dataset: {turns} (dataset 'turns'): 8 of 8 rows are not sharegpt conversations"), errors
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
