"""Bad inputs that used to fail late (a traceback at the first step or save) or be silently overridden: each is now
one line from the one validation step, before any process group (torch-free, so --dry-run finds it too)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fsdp2_backend.launch import parse_command_line
from tests.support.launchers import REPO
from tests.support.tiny_models import tiny_model_dir
from fsdp2_backend.usage_errors import UsageError

SCRATCH = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
           "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 8 --lr 1e-3 "
           "--min-lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu --normalization RMSNorm "
           "--disable-bias-linear --position-embedding-type rope --hidden-dropout 0 --save /tmp/faults-out").split()


def errors_of(argv, world_size=1):
    with pytest.raises(UsageError) as caught:
        parse_command_line(argv, world_size)
    return caught.value.messages


def replaced(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("hf"), seed=0)


def test_megatron_shape_assertions_are_one_line_each():
    assert errors_of(replaced(SCRATCH, "--hidden-size", "66")) == [
        "--hidden-size: 66 is not divisible by --num-attention-heads 4 (Megatron asserts hidden_size % "
        "num_attention_heads == 0 without --kv-channels) — change one, or give --kv-channels"]
    assert errors_of(replaced(SCRATCH, "--seq-length", "128")) == [
        "--seq-length: 128 exceeds --max-position-embeddings 64 (Megatron asserts max_position_embeddings >= "
        "seq_length) — raise --max-position-embeddings or shorten --seq-length"]
    assert errors_of(SCRATCH + ["--group-query-attention", "--num-query-groups", "3"]) == [
        "--num-query-groups: 3 does not divide --num-attention-heads 4 — use a divisor of 4"]
    assert errors_of(SCRATCH + ["--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1"]) == [
        "--lr-warmup-fraction: given with --lr-warmup-iters (Megatron accepts only one of them) — drop one"]


def test_values_no_run_can_use():
    assert errors_of(replaced(SCRATCH, "--lr", "-1")) == [
        "training.lr: must be >= 0, got -1.0 (Megatron --lr) — give the peak learning rate"]
    assert errors_of(SCRATCH + ["--num-workers", "-1"]) == [
        "training.dataloader_num_workers: must be >= 0 (0 loads in the main process), got -1 (Megatron "
        "--num-workers)"]
    assert errors_of(SCRATCH + ["--split", "0,0,0"]) == [
        "data.split: '0,0,0' gives the training split no documents — give it a positive weight such as 969,30,1 "
        "(Megatron --split)"]
    assert errors_of(SCRATCH + ["--split", "90,-5,15"]) == [
        "data.split: '90,-5,15' has a negative weight — give non-negative weights such as 969,30,1 (Megatron "
        "--split)"]
    assert errors_of(SCRATCH + ["--exit-signal-handler", "--exit-signal", "SIGNOPE"]) == [
        "training.exit_signal: 'SIGNOPE' is no signal — give a name such as SIGTERM or SIGUSR1, or its number "
        "(Megatron --exit-signal)"]
    assert errors_of(SCRATCH + ["--clip-grad", "-1", "--weight-decay", "-0.1", "--adam-beta1", "1.5", "--adam-eps",
                                "0", "--seed", "-1"]) == [
        "training.max_grad_norm: must be >= 0, got -1.0 (Megatron --clip-grad)",
        "training.weight_decay: must be >= 0, got -0.1 (Megatron --weight-decay)",
        "training.adam_beta1: must lie in [0, 1), got 1.5 (Megatron --adam-beta1)",
        "training.adam_epsilon: must be positive, got 0.0 (Megatron --adam-eps)",
        "training.seed: must lie in [0, 2**32) (numpy's seeds), got -1 (Megatron --seed)"]
    assert errors_of(replaced(SCRATCH, "--lr", "nan")) == [
        "training.lr: must be >= 0, got nan (Megatron --lr) — give the peak learning rate"]
    config, _ = parse_command_line(SCRATCH + ["--exit-signal-handler", "--exit-signal", "SIGUSR1"], 1)
    assert (config.training.exit_signal_handler, config.training.exit_signal) == (True, "SIGUSR1")
    config, _ = parse_command_line(SCRATCH + ["--no-check-for-nan-in-loss-and-grad"], 1)
    assert config.training.check_for_nan_in_loss_and_grad is False
    assert parse_command_line(SCRATCH, 1)[0].training.check_for_nan_in_loss_and_grad is True  # Megatron's default


def test_contradictory_native_fields_are_refused(tmp_path):
    native = ["--training.stage", "pt", "--data.data_manager_type", "mg", "--data.mock_data", "true",
              "--model.architecture", '{"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64, '
              '"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}',
              "--training.output_dir", str(tmp_path / "out"), "--training.max_steps", "8",
              "--training.per_device_train_batch_size", "2"]
    assert errors_of(native + ["--training.global_batch_size", "8", "--training.gradient_accumulation_steps", "2"],
                     world_size=1) == [
        "training.gradient_accumulation_steps: 2 contradicts global_batch_size 8 (= micro batch 2 x data-parallel 1 "
        "x 4 steps) — give only one of them"]
    assert errors_of(native + ["--training.warmup_ratio", "0.1", "--training.lr_warmup_iters", "2"]) == [
        "training.warmup_ratio: 0.1 contradicts training.lr_warmup_iters 2 (Megatron refuses --lr-warmup-fraction "
        "with --lr-warmup-iters) — give only one of them"]
    assert errors_of(native + ["--model.architecture", '{"model_type": "qwen3", "vocab_size": 128, '
                               '"hidden_size": 66, "num_hidden_layers": 2, "num_attention_heads": 4}']) == [
        "model.architecture.hidden_size: 66 is not divisible by num_attention_heads 4 (and no head_dim is given) — "
        "change one of them (Megatron --hidden-size / --num-attention-heads) or give head_dim (--kv-channels)"]
    # agreeing values pass
    config, _ = parse_command_line(native + ["--training.global_batch_size", "8",
                                             "--training.gradient_accumulation_steps", "4"], 1)
    assert config.training.gradient_accumulation_steps == 4


def test_megatrons_default_hidden_dropout_is_said_to_vanish():
    argv = [a for i, a in enumerate(SCRATCH) if a != "--hidden-dropout" and SCRATCH[i - 1] != "--hidden-dropout"]
    _, report = parse_command_line(argv, 1)
    assert ("warning: --hidden-dropout: Megatron's default 0.1 is not applied — HF llama models have no hidden "
            "dropout (give --hidden-dropout 0 to say so)") in report
    _, report = parse_command_line(SCRATCH, 1)
    assert not any("Megatron's default 0.1" in line for line in report)


def test_gpt_style_flags_are_checked_against_the_hf_config(hf_dir):
    """GPT-2-style flags over a loaded Llama/Qwen-style model: named as the loaded config names them."""
    gpt = ["--load", hf_dir, "--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4",
           "--position-embedding-type", "learned_absolute", "--seq-length", "32", "--max-position-embeddings", "256",
           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--mock-data",
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir, "--save", "/tmp/faults-out"]
    assert errors_of(gpt) == [
        f"model.architecture.num_hidden_layers (from --num-layers): the flags say 3 but {hf_dir} config.json says "
        f"2 — fix the flag, or drop the architecture flags (the model is defined there)"]
    parse_command_line(replaced(gpt, "--num-layers", "2"), 1)  # agreeing flags pass


def _hf_copy(hf_dir, tmp_path, edit_config=None, truncate=False):
    target = tmp_path / "model"
    shutil.copytree(hf_dir, target)
    if edit_config:
        config = json.loads((target / "config.json").read_text())
        edit_config(config)
        (target / "config.json").write_text(json.dumps(config))
    if truncate:
        weights = target / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    return str(target)


def _hf_run(model):
    return ["--load", model, "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "4", "--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            model, "--save", "/tmp/faults-out"]


def test_a_config_json_missing_fields_is_refused(hf_dir, tmp_path):
    model = _hf_copy(hf_dir, tmp_path, lambda c: c.pop("vocab_size"))
    assert errors_of(_hf_run(model)) == [
        f"{model}/config.json: no vocab_size — transformers would fill in the defaults of qwen3 (another model's "
        f"sizes); add it to config.json"]


def test_a_truncated_safetensors_file_is_refused(hf_dir, tmp_path):
    model = _hf_copy(hf_dir, tmp_path, truncate=True)
    size = os.path.getsize(f"{model}/model.safetensors")
    assert errors_of(_hf_run(model)) == [
        f"model.model_name_or_path (--load): {model}/model.safetensors cannot be read as safetensors ({size} bytes "
        f"where its header describes {2 * size} (truncated or corrupt)) — copy or download it again"]


def test_weights_that_do_not_fit_the_config_are_one_line(hf_dir, tmp_path):
    from fsdp2_backend.models.loading import create_model, load_hf_config

    model = _hf_copy(hf_dir, tmp_path, lambda c: c.update(intermediate_size=96))
    config, _ = parse_command_line(_hf_run(model), 1)  # the shapes are in the weights: found when loading them
    with pytest.raises(UsageError) as caught:
        create_model(config.model, load_hf_config(config.model), seed=0, device="cpu", parallelize=lambda m: m)
    assert caught.value.messages == [
        f"model.model_name_or_path (--load): 6 weights in {model} do not match the shapes its config.json "
        f"describes: model.layers.0.mlp.gate_proj.weight [128, 64] (config: [96, 64]); "
        f"model.layers.0.mlp.up_proj.weight [128, 64] (config: [96, 64]); model.layers.0.mlp.down_proj.weight "
        f"[64, 128] (config: [64, 96]) and 3 more — use the config.json that belongs to these weights"]


def test_an_unusable_save_directory_is_found_at_start(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert errors_of(replaced(SCRATCH, "--save", str(a_file))) == [
        f"training.output_dir (--save): {a_file} is a file, not a directory — give a directory"]
    assert errors_of(replaced(SCRATCH, "--save", str(a_file / "out"))) == [
        f"training.output_dir (--save): {a_file} is a file, so {a_file / 'out'} cannot be created — give a "
        f"directory path"]


def run_cli(*args, env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=300)


def test_help_is_short_and_the_full_lists_come_on_request():
    short = run_cli("--help")
    assert short.returncode == 0
    lines = short.stdout.splitlines()
    assert lines[0] == ("usage: [torchrun --nproc_per_node N] pretrain_fsdp2.py [CONFIG.yaml] [--group.field VALUE "
                        "...] [Megatron/MindSpeed flags ...] [--dry-run]")
    assert len(lines) < 30 and "--group.field" in short.stdout and "--dry-run" in short.stdout
    assert "CONFIG.yaml" in short.stdout and "--help-flags" in short.stdout
    flags = run_cli("--help-flags")
    assert flags.returncode == 0 and "--num-layers" in flags.stdout and len(flags.stdout.splitlines()) > 1000
    fields = run_cli("--help-config")
    assert fields.returncode == 0 and "--training.check_for_nan_in_loss_and_grad (bool, default True)" in fields.stdout
    bare = run_cli()
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr.splitlines() == [lines[0], "error: no arguments — give a YAML config, Megatron flags or both "
                                                  "(pretrain_fsdp2.py --help)"]
