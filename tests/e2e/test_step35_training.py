"""MindSpeed-LLM's step35 YAMLs (paths replaced, sizes scaled to 2 CPU ranks) train a tiny Step-3.5 with the step35
model id from a checkpoint in Step-3.5's own on-disk layout (meta-device init, so the streaming loader maps
`moe.*` / `share_expert.*` keys): one rank, expert parallel 2 (the examples YAML, grouped GEMM) and ep_fsdp 2
(the CI pipeline YAML, recompute on) on 2 ranks train 8 steps in fp32 (see `_train`) and print the same lm loss
(1e-4) at every step; the EP 2 checkpoint of step 4 continues at one rank, its step 5 = EP 2's step 5; the
EP 2 run's HF export holds exactly Step-3.5's keys (tests/models/test_step35.py streams such an export back). The
f88dd26d copy of the examples YAML dry-runs at its launcher's world size (192); MindSpeed-LLM v26.1.0's copy of the
pipeline YAML trains 3 steps under ep_fsdp 2."""
import json
import os
import shutil
import sys

import pytest
import torch

from tests.support.launchers import REPO, torchrun_command
from tests.support.launchers import failure_report, run_command, train_lines
from tests.support.step35_reference import step35_config_dict
from tests.support.step35_yaml import DATA, STEP35_EXAMPLES, STEP35_FLASH
from tests.support.step35_yaml import assets  # noqa: F401  (pytest fixture)

PIPELINE = os.path.join(DATA, "head", "tests__pipeline__st__step35-flash__pretrain_step_3p5_flash_4K_fsdp2.yaml")
OLD = os.path.join(DATA, "f88dd26d", "examples__fsdp2__step35__pretrain_step_3p5_flash_196b_4K_fsdp2_A3.yaml")
RELEASE_PIPELINE = PIPELINE.replace(os.sep + "head" + os.sep, os.sep + "v26.1.0" + os.sep)  # MindSpeed v26.1.0's


def _train(assets, yaml_file, out, ranks, ep, ep_fsdp, *extra, steps=8):
    from fsdp2_backend.training.logging import parse_train_line

    args = ["--model.model_name_or_path", assets["model"], "--model.tokenizer_name_or_path", assets["model"],
            "--data.dataset", assets["dataset"], "--parallel.fsdp_size", str(ranks), "--parallel.ep_size", str(ep),
            "--parallel.ep_fsdp_size", str(ep_fsdp), "--training.per_device_train_batch_size", "1",
            "--training.gradient_accumulation_steps", str(3 - ranks), "--training.output_dir", str(out),
            "--training.max_steps", str(steps), "--data.cutoff_len", "32", "--training.save_steps", "4",
            "--training.lr", "1e-3", "--training.lr_scheduler_type", "constant",
            "--training.warmup_ratio", "0",  # the CI YAML has no warmup_ratio: the default 0.03 warms up
            # fp32 compute (the YAMLs say bf16): under EP an expert's weight gradient is one bf16 GEMM over the
            # tokens of both ranks, at one rank one per micro-batch, so the bf16 roundings differ (~2e-3 of the
            # expert gradients, every other gradient equal bit for bit), and AdamW turns that into lr-sized steps
            # on near-zero gradient entries: the layouts then agree to ~1e-4 at step 2 only, drifting after
            "--parallel.param_dtype", "fp32", *extra]
    command = torchrun_command(ranks, os.path.join(REPO, "pretrain_fsdp2.py"), yaml_file, *args)
    result = run_command(command, {}, timeout=900)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    return {line["iteration"]: line["losses"]["lm loss"] for line in train_lines(log, parse_train_line)}, log


def _checkpoint(out, iteration):
    found = [os.path.join(root, d) for root, dirs, _ in os.walk(out) for d in dirs if d == f"iter_{iteration:07d}"]
    assert len(found) == 1, found
    return found[0]


def test_step35_yamls_train_under_ep2_and_ep_fsdp2_and_continue_at_one_rank(assets, tmp_path):
    one, log = _train(assets, STEP35_EXAMPLES, tmp_path / "one", ranks=1, ep=1, ep_fsdp=1)
    assert sorted(one) == list(range(1, 9)), log[-3000:]
    assert "MTP layers (model.layers.4-4) are not loaded" in log
    ep2, log = _train(assets, STEP35_EXAMPLES, tmp_path / "ep2", 2, 2, 1, "--optimization.moe_grouped_gemm", "True")
    assert sorted(ep2) == list(range(1, 9)), log[-3000:]
    ep_fsdp, log = _train(assets, PIPELINE, tmp_path / "ep_fsdp", 2, 1, 2, "--parallel.recompute", "True")
    assert sorted(ep_fsdp) == list(range(1, 9)), log[-3000:]
    for run in (one, ep2, ep_fsdp):
        assert all(0 < loss < 10 for loss in run.values()) and run[8] < run[1], run  # finite, and it trains
    # every step: the same losses under every layout (step 1 is the forward of the checkpoint's weights)
    for step in range(1, 9):
        assert ep2[step] == pytest.approx(one[step], rel=1e-4), (step, one, ep2)
        assert ep_fsdp[step] == pytest.approx(one[step], rel=1e-4), (step, one, ep_fsdp)
    # the EP 2 export: Step-3.5's on-disk keys (no MTP layer)
    from safetensors import safe_open

    keys = set()
    for f in (tmp_path / "ep2" / "hf").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as handle:
            keys |= set(handle.keys())
    assert keys == {k for k in assets["keys"] if not k.startswith("model.layers.4.")}
    # the EP 2 checkpoint of step 4 continues at one rank: step 5 is the forward of the saved weights
    shutil.copytree(_checkpoint(tmp_path / "ep2", 4), tmp_path / "ckpt" / "iter_0000004")
    continued, log = _train(assets, STEP35_EXAMPLES, tmp_path / "continued", 1, 1, 1,
                            "--training.resume_from_checkpoint", str(tmp_path / "ckpt"))
    assert sorted(continued) == [5, 6, 7, 8], log[-3000:]
    assert continued[5] == pytest.approx(ep2[5], rel=1e-5), (continued, ep2)
    assert all(0 < loss < 10 for loss in continued.values()), continued


def test_release_pipeline_yaml_trains_under_ep_fsdp2(assets, tmp_path):
    """MindSpeed-LLM v26.1.0's copy of the CI pipeline YAML (its paths, sizes and ep layout inside, overridden as a
    user pointing it at their files would) trains 3 steps under ep_fsdp 2 with recompute."""
    release, log = _train(assets, RELEASE_PIPELINE, tmp_path / "release", 2, 1, 2, "--parallel.recompute", "True",
                          steps=3)
    assert sorted(release) == [1, 2, 3] and all(0 < loss < 10 for loss in release.values()), log[-3000:]


def test_f88dd26d_step35_yaml_dry_runs_at_its_world_size(assets, tmp_path):
    import yaml

    real = tmp_path / "Step-3.5-Flash"  # the published model's sizes that the layout checks read
    shutil.copytree(assets["model"], real)
    (real / "model.safetensors").unlink()
    (real / "config.json").write_text(json.dumps(step35_config_dict(**STEP35_FLASH)))
    command = [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), OLD, "--model.model_name_or_path",
               str(real), "--model.tokenizer_name_or_path", str(real), "--data.dataset",
               assets["dataset"], "--training.output_dir", str(tmp_path / "out"), "--dry-run"]
    result = run_command(command, {"WORLD_SIZE": "192"}, timeout=300)
    assert result.returncode == 0, failure_report(result, command)
    parallel = yaml.safe_load(result.stdout)["parallel"]
    assert (parallel["ep_size"], parallel["ep_fsdp_size"], parallel["fsdp_size"]) == (96, 2, 192)
