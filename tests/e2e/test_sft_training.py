"""`stage: sft` end to end through pretrain_fsdp2.py: the per-token loss over the global batch's valid tokens is
the same on 1 rank (gradient accumulation 2) and on 2 data-parallel ranks, evaluation prints a loss block per
dataset at each interval and at the end, and neat-packed rows under Ulysses context parallel 2 train like one
rank."""
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from tests.support.launchers import MEGATRON_LINE, REPO, free_port
from tests.support.sft_assets import alpaca_rows, qwen3_model_dir, write_jsonl

RTOL = 1e-5
VALIDATION = re.compile(r"validation loss at iteration (\d+)(?: on ([^|]+?))? \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_train")
    model = qwen3_model_dir(root / "model", seed=0)
    write_jsonl(root / "a.jsonl", alpaca_rows(24, seed=1))
    write_jsonl(root / "b.jsonl", alpaca_rows(12, seed=2))
    (root / "dataset_info.json").write_text(json.dumps({"set_a": {"file_name": "a.jsonl"},
                                                        "set_b": {"file_name": "b.jsonl", "formatting": "alpaca"}}))
    return {"root": root, "model": model}


def _yaml(assets, name, data=None, training=None, parallel=None):
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
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                   str(free_port()), *entry]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    return {int(it): (int(c), loss) for it, c, loss in MEGATRON_LINE.findall(log)}, log


def _losses(lines):
    return {it: float(loss) for it, (_, loss) in lines.items()}


def _close(a, b):
    assert a.keys() == b.keys() and a, (a, b)
    for key in a:
        assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (key, a[key], b[key])


def test_one_rank_equals_two_ranks_and_evaluates_each_dataset(assets, tmp_path):
    data = {"val_size": 3, "eval_on_each_dataset": True}
    one = _yaml(assets, "one", data, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                                      "eval_interval": 2})
    two = _yaml(assets, "two", data, {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1,
                                      "eval_interval": 2})
    lines1, log1 = run_sft(one, tmp_path / "one", ranks=1)
    lines2, log2 = run_sft(two, tmp_path / "two", ranks=2)
    _close(_losses(lines2), _losses(lines1))
    evals1 = [(int(i), where, float(v)) for i, where, v in VALIDATION.findall(log1)]
    evals2 = [(int(i), where, float(v)) for i, where, v in VALIDATION.findall(log2)]
    # a block per dataset at iterations 2 and 4, and once more at the end
    assert [(i, w) for i, w, _ in evals1] == [(2, "eval set set_a"), (2, "eval set set_b"),
                                              (4, "eval set set_a"), (4, "eval set set_b"),
                                              (4, "eval set set_a"), (4, "eval set set_b")], log1[-3000:]
    assert [(i, w) for i, w, _ in evals2] == [(i, w) for i, w, _ in evals1]
    for (_, _, v1), (_, _, v2) in zip(evals1, evals2):
        assert abs(v1 - v2) <= RTOL * abs(v1)


def test_neat_packing_with_ulysses_cp2_equals_one_rank(assets, tmp_path):
    data = {"neat_packing": True, "cutoff_len": 128}
    training = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    one = _yaml(assets, "packed_one", data, training)
    cp2 = _yaml(assets, "packed_cp2", data, training, {"cp_size": 2, "cp_type": "ulysses"})
    lines1, _ = run_sft(one, tmp_path / "one", ranks=1)
    lines2, log2 = run_sft(cp2, tmp_path / "cp2", ranks=2)
    _close(_losses(lines2), _losses(lines1))
