"""MindSpeed-LLM's own FSDP2 YAML files and launchers run unchanged: the Qwen3 and Qwen3-MoE pretraining configs.

tests/data/mindspeed_fsdp2/ holds verbatim copies of MindSpeed-LLM's files (file name = repository path with '/'
replaced by '__'): `f88dd26d/` (commit f88dd26d, files that differ from HEAD or are gone there), `head/`
(commit c77308a1), `v26.1.0/` (the release, branch and tag 26.1.0: files that differ from master's) and
`launchers.json` ({commit: {launcher .sh: {yaml, args, world}}}: the YAML a launcher runs,
the `--group.field value` arguments it adds and the world size it runs at).

For every launcher in scope, with only its paths replaced (model and tokenizer → a directory holding the real
model's config.json and a tiny tokenizer, the dataset → a small parquet file of raw text, output_dir → tmp):
- `pretrain_fsdp2.py YAML ARGS --dry-run` at the launcher's world size validates and prints the config as YAML;
- one launcher per (commit, model family) trains 3 steps on 2 gloo ranks, scaled down by overrides appended to
  its arguments, from the raw parquet text as MindSpeed does, and prints 3 Megatron log lines with finite losses.
SFT launchers (`tune_*`, stage sft with the lf data path) dry-run the same way and train 3 steps on 2 ranks from
an alpaca parquet file (tests/test_sft_*.py test the SFT path itself). The mxfp8 launchers
(`--model.quant_recipe_name mxfp8`) dry-run with their quant fields (tests/test_mx_*.py train with them).
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest
import yaml

from tests.support.launchers import REPO, failure_report, torchrun_command, run_command, train_lines
from tests.support.mindspeed_yaml import LAUNCHERS, MAPPED, real_model_name, with_paths
from tests.support.mindspeed_yaml import assets  # noqa: F401  (pytest fixture)


# One launcher per (commit, model family) trains on 2 ranks; the others only dry-run.
TRAINED = {
    ("f88dd26d", "tests__st__shell_scripts__pretrain_qwen3_8b_4k_fsdp2.sh"),            # cp 2 ring, save_steps 0
    ("f88dd26d", "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_A3.sh"),      # paths in the YAML
    ("head", "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh"),               # head-only YAML
    ("head", "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh"),         # EP 2
    ("v26.1.0", "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh"),            # release-only YAML
    ("v26.1.0", "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh"),      # release-only, EP 2
}


UNMAPPED = [(commit, launcher, entry["yaml"]) for commit, launcher, entry, path in LAUNCHERS if path is None]
PRETRAIN = [case for case in MAPPED if "tune_" not in case[1]]
SFT = [case for case in MAPPED if "tune_" in case[1]]


def _ids(cases):
    return [f"{commit}:{launcher[:-3]}" for commit, launcher, *_ in cases]


def _family(yaml_name: str) -> str:
    return "qwen3_moe" if real_model_name(yaml_name).startswith(("Qwen3-30B", "Qwen3-235B")) else "qwen3"


def _dry_run(assets, tmp_path, yaml_file, entry):
    model = assets["real"](real_model_name(yaml_file.name))
    dataset = json.dumps({"file_name": assets["parquet"]})
    args = with_paths(yaml_file, entry["args"], (model, model, dataset, str(tmp_path / "output")))
    command = [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args, "--dry-run"]
    return command, run_command(command, {"WORLD_SIZE": str(entry["world"])}, timeout=300)


def test_every_launcher_in_scope_maps_to_a_copied_yaml():
    """Launchers whose YAML path names no copied file (MindSpeed's own launcher points at a file that does not
    exist) are listed here rather than silently dropped; the list is what upstream ships today."""
    assert len(PRETRAIN) == 27 and len(SFT) == 2, _ids(PRETRAIN + SFT)
    assert sorted(launcher for _, launcher, _ in UNMAPPED) == [
        "examples__fsdp2__qwen3__pretrain_qwen3_1point7b_4k_fsdp2_A2.sh",
        "examples__fsdp2__qwen3__tune_qwen3_1point7b_4k_fsdp2_A2.sh"], UNMAPPED
    # the release's launchers run its own copies where the release's files differ from master's
    release = {launcher: path.parent.name for commit, launcher, _, path in MAPPED if commit == "v26.1.0"}
    assert [name for name, where in sorted(release.items()) if where == "v26.1.0"] == [
        "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3__tune_qwen3_8b_4k_fsdp2_A2.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_quant_A5.sh"], release


QUANT = [case for case in PRETRAIN if "--model.quant_recipe_name" in case[2]["args"]]
FULL_PRECISION = [case for case in PRETRAIN if case not in QUANT]


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", QUANT, ids=_ids(QUANT))
def test_mxfp8_launcher_dry_runs_with_its_quant_fields(assets, tmp_path, commit, launcher, entry, yaml_file):
    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    model = yaml.safe_load(result.stdout)["model"]
    assert model["quant_recipe_name"] == "mxfp8" and model["enable_fsdp_low_precision_all_gather"] is True
    assert model["quant_converters"] == ["quantize.linear.mx", "quantize.moe.mx"]


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", FULL_PRECISION, ids=_ids(FULL_PRECISION))
def test_dry_run_at_launcher_world_size(assets, tmp_path, commit, launcher, entry, yaml_file):
    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    printed = yaml.safe_load(result.stdout)
    assert isinstance(printed, dict) and printed["training"]["stage"] == "pt", result.stdout[-2000:]
    assert printed["model"]["model_name_or_path"] == assets["real"](real_model_name(yaml_file.name))
    assert printed["training"]["output_dir"] == str(tmp_path / "output")


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", SFT, ids=_ids(SFT))
def test_sft_launcher_dry_runs_and_trains_on_two_ranks(assets, tmp_path, commit, launcher, entry, yaml_file):
    """MindSpeed's qwen3 tune YAML (stage sft, template qwen3, an inline alpaca dataset), paths replaced: its
    dry run at the launcher's world size prints stage sft, and scaled down it trains 3 steps on 2 gloo ranks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp2_backend.training.logging import parse_train_line
    from tests.support.sft_assets import alpaca_rows

    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    assert yaml.safe_load(result.stdout)["training"]["stage"] == "sft", result.stdout[-2000:]
    if commit == "v26.1.0":  # the release's copy differs from master's in its paths and sizes only: dry run alone
        return
    parquet = tmp_path / "train-00000-of-00001-a09b74b3ef9c3b56.parquet"
    pq.write_table(pa.Table.from_pylist(alpaca_rows(32)), str(parquet))
    model, output = assets["tiny"]("qwen3"), str(tmp_path / "output")
    dataset = json.dumps({"file_name": str(parquet), "formatting": "alpaca"})
    args = with_paths(yaml_file, entry["args"], (model, model, dataset, output))
    args += ["--model.model_name_or_path", model, "--parallel.fsdp_size", "2", "--training.max_steps", "3",
             "--data.cutoff_len", "64", "--training.per_device_train_batch_size", "1",
             "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
             "--training.output_dir", output, "--training.dataloader_num_workers", "0"]
    command = torchrun_command(2, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    assert all(math.isfinite(line["losses"]["lm loss"]) for line in lines)


TRAIN_CASES = [case for case in PRETRAIN if (case[0], case[1]) in TRAINED]


def _scaled_ep(entry) -> str:
    args = entry["args"]
    ep = int(args[args.index("--parallel.ep_size") + 1]) if "--parallel.ep_size" in args else 1
    return "2" if ep > 1 else "1"


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", TRAIN_CASES, ids=_ids(TRAIN_CASES))
def test_trains_three_steps_on_two_ranks(assets, tmp_path, commit, launcher, entry, yaml_file):
    from fsdp2_backend.training.logging import parse_train_line

    model = assets["tiny"](_family(yaml_file.name))
    dataset = json.dumps({"file_name": assets["parquet"]})
    output = str(tmp_path / "output")
    args = with_paths(yaml_file, entry["args"], (model, model, dataset, output))
    args += ["--model.model_name_or_path", model, "--parallel.fsdp_size", "2",
             "--parallel.ep_size", _scaled_ep(entry), "--parallel.ep_fsdp_size", "1",
             "--training.max_steps", "3", "--data.cutoff_len", "64", "--training.per_device_train_batch_size", "1",
             "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
             "--training.output_dir", output]  # the YAML's own data loader workers
    command = torchrun_command(2, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    for line in lines:
        loss = line["losses"].get("lm loss")
        assert loss is not None and math.isfinite(loss), line
