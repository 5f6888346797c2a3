"""Megatron's --load / --save as a user types them, through the real entry point.

- `--load X --save X` with X empty starts from scratch; the very same command rerun resumes from X;
- `--load CKPT` without any architecture flag resumes (the checkpoint describes its model) — on 2 ranks,
  steps 7..12 equal to a straight run;
- `--load CKPT --save NEW --finetune` starts at iteration 0 from CKPT's weights;
- a native YAML plus a Megatron flag (`--lr`) keeps the YAML's model.
"""
import os
import subprocess
import sys

import pytest
import yaml

from tests.support.launchers import REPO, run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS
from tests.support.megatron_lines import without_architecture

pytestmark = pytest.mark.e2e


def losses(lines):
    return {it: float(loss) for it, (_, loss) in lines.items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    lines, _ = run_pretrain(RESUME_RUN_FLAGS, tmp_path_factory.mktemp("straight"))
    assert sorted(lines) == list(range(1, 13))
    return lines


def test_load_equals_save_starts_fresh_then_resumes(straight, tmp_path):
    run = tmp_path / "run"
    first, log = run_pretrain(RESUME_RUN_FLAGS, run, "--load", str(run), "--exit-interval", "6")
    assert f"no checkpoint found in {run}: training starts from scratch" in log
    assert sorted(first) == list(range(1, 7))
    second, log = run_pretrain(RESUME_RUN_FLAGS, run, "--load", str(run), "--exit-interval", "6")
    assert "resuming from the newest complete checkpoint" in log
    assert sorted(second) == list(range(7, 13))
    for it in range(1, 13):
        assert (first if it <= 6 else second)[it] == straight[it], it


def test_load_of_a_checkpoint_needs_no_architecture_flags(straight, tmp_path):
    stopped = tmp_path / "stopped"
    run_pretrain(RESUME_RUN_FLAGS, stopped, "--exit-interval", "6")
    bare = without_architecture(RESUME_RUN_FLAGS)
    assert "--num-layers" not in bare and "--hidden-size" not in bare
    resumed, log = run_pretrain(bare, tmp_path / "continued", "--load", str(stopped), ranks=2)
    assert f"resuming from the newest complete checkpoint {stopped / 'iter_0000006'}" in log
    assert sorted(resumed) == list(range(7, 13))
    for it in range(7, 13):
        consumed, loss = resumed[it]
        assert consumed == straight[it][0]
        assert abs(float(loss) - float(straight[it][1])) <= 1e-5 * abs(float(straight[it][1])), it


def test_finetune_starts_at_iteration_zero_from_the_loaded_weights(straight, tmp_path):
    trained = tmp_path / "trained"
    run_pretrain(RESUME_RUN_FLAGS, trained)
    tuned, log = run_pretrain(without_architecture(RESUME_RUN_FLAGS), tmp_path / "tuned", "--load", str(trained),
                              "--finetune", "--train-iters", "3")
    assert "successfully loaded checkpoint" in log and "at iteration 0" in log
    assert sorted(tuned) == [1, 2, 3] and tuned[1][0] == straight[1][0]  # iteration and samples from 0
    # The same first batch scores far better with the trained weights than with a fresh initialisation.
    assert float(tuned[1][1]) < float(straight[1][1]) - 0.5, (tuned[1], straight[1])
    assert (tmp_path / "tuned" / "iter_0000003").is_dir() and not (tmp_path / "tuned" / "iter_0000012").exists()


def test_a_yaml_plus_a_megatron_flag_keeps_the_yamls_model(tmp_path):
    config = {"model": {"architecture": {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64,
                                         "intermediate_size": 128, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128},
                        "tokenizer_type": "NullTokenizer", "vocab_size": 128},
              "data": {"mock_data": True, "cutoff_len": 32, "data_manager_type": "mg"},
              "training": {"stage": "pt", "max_steps": 2, "per_device_train_batch_size": 2,
                           "output_dir": str(tmp_path / "out"), "logging_steps": 1,
                           "log_throughput": True, "log_cpu_memory": True}}  # MindSpeed's log fields
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    entry = [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), str(path), "--lr", "2e-3"]
    dry = subprocess.run(entry + ["--dry-run"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert dry.returncode == 0, dry.stderr[-2000:]
    printed = yaml.safe_load(dry.stdout)
    assert printed["training"]["lr"] == 2e-3 and printed["model"]["architecture"]["num_hidden_layers"] == 2
    run = subprocess.run(entry, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    log = run.stdout + run.stderr
    assert "iteration        2/       2" in log
    assert " throughput per GPU (TFLOP/s/GPU): " in log and " cpu memory (GiB): current " in log
