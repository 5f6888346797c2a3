"""Megatron's monitoring options in-process: the params norm against torch's own norm, the flags' translation
and validation, and progress.txt's cumulative-throughput bookkeeping."""
import math

import pytest
import torch

from fsdp2_backend.config import Config
from fsdp2_backend.config.validation import validate_with_notices
from fsdp2_backend.training.logging import TrainLogger, parse_train_line
from fsdp2_backend.training.metrics_writers import ProgressLog, memory_scalars, params_l2_norm
from fsdp2_backend.usage_errors import UsageError


def test_params_norm_is_torchs_norm_of_all_parameters_and_in_the_line():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    expected = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()])).item()
    assert math.isclose(params_l2_norm(model), expected, rel_tol=1e-6)
    logger = TrainLogger(train_iters=4, log_interval=2, global_batch_size=1, world_size=1, device=torch.device("cpu"),
                         is_logging_rank=True, tokens_per_iteration=8, print_fn=lambda line: None,
                         params_norm_fn=lambda: params_l2_norm(model))
    common = dict(losses={"lm loss": 1.0}, skipped=False, learning_rate=1e-3, grad_norm=0.5, consumed_samples=1)
    assert logger.record(1, **common) is None
    assert parse_train_line(logger.record(2, **common))["params_norm"] == float(f"{expected:.3f}")


def test_memory_scalars_on_cpu_are_the_process_rss():
    import resource

    scalars = memory_scalars(torch.device("cpu"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 2**20 < scalars["mem-allocated-bytes"] <= scalars["mem-max-allocated-bytes"]
    assert abs(scalars["mem-max-allocated-bytes"] - peak) < 64 * 2**20


def _config(**training):
    config = Config()
    config.model.model_name_or_path = "unused"
    config.data.mock_data = True
    config.data.data_manager_type = "mg"
    config.training.stage = "pt"
    config.training.max_steps = 2
    config.training.save_checkpoints = False
    for key, value in training.items():
        setattr(config.training, key, value)
    return config


def test_wandb_needs_an_experiment_name_as_in_megatron():
    with pytest.raises(UsageError) as err:
        validate_with_notices(_config(wandb_project="p"))
    assert "training.wandb_exp_name: required with wandb_project" in str(err.value)


def test_tensorboard_extras_without_a_destination_are_reported_once():
    _, notices = validate_with_notices(_config(log_timers_to_tensorboard=True, log_progress=True))
    assert "training.log_timers_to_tensorboard: no effect without training.tensorboard_dir or " \
           "training.wandb_project" in notices
    assert any(n.startswith("training.log_progress: no effect without checkpoints") for n in notices)
    _, notices = validate_with_notices(_config(log_timers_to_tensorboard=True, tensorboard_dir="tb"))
    assert not any("log_timers" in n for n in notices)


def test_megatron_flags_reach_the_fields():
    from megatron_compat.translate import translate_report

    translation = translate_report(["--wandb-project", "proj", "--wandb-exp-name", "exp", "--wandb-entity", "team",
                                    "--log-params-norm", "--log-progress", "--tensorboard-log-interval", "5",
                                    "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
                                    "--log-validation-ppl-to-tensorboard"])
    t = translation.fields["training"]
    assert (t["wandb_project"], t["wandb_exp_name"], t["wandb_entity"]) == ("proj", "exp", "team")
    assert not t.get("wandb_save_dir")  # Megatron's default '': unset (output_dir/wandb)
    assert t["log_params_norm"] and t["log_progress"] and t["tensorboard_log_interval"] == 5
    assert t["log_timers_to_tensorboard"] and t["log_memory_to_tensorboard"]
    assert t["log_validation_ppl_to_tensorboard"]
    no_effect = set(translation.report.no_effect)
    assert not no_effect & {"--wandb-project", "--log-params-norm", "--log-progress", "--log-timers-to-tensorboard"}


def test_progress_log_cumulative_throughput_counts_from_the_first_job_of_this_size(tmp_path):
    # An earlier job on 8 GPUs, then one on 2 GPUs that saved at iteration 10 (the lines Megatron writes).
    (tmp_path / "progress.txt").write_text(
        "2026-01-01 00:00:00\tJob ID: \t# GPUs: 8\tStarting job\n"
        "2026-01-01 01:00:00\tJob ID: \t# GPUs: 2\tStarting job\n"
        "2026-01-01 02:00:00\tJob ID: \t# GPUs: 2\tSaved checkpoint\tIteration: 10\tJob throughput: 1.0 TFLOP/s/GPU"
        "\tCumulative throughput: 1.0 TFLOP/s/GPU\tFloating-point operations: 1.00e+15\tTokens (in billions): 0.00\n")
    log = ProgressLog(str(tmp_path), world_size=2, is_writer=True, seq_length=4, flops_per_iteration=1e14,
                      start_iteration=10)
    start, start_flops = log._first_start()
    assert str(start) == "2026-01-01 01:00:00" and start_flops == 0.0
    log.start()
    log.saved_checkpoint(20, consumed_samples=80)
    log.saved_checkpoint(20, consumed_samples=80)  # the final save of an interval iteration: one line
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert len(lines) == 5 and lines[3].endswith("\tStarting job")
    fields = lines[4].split("\t")
    assert fields[3:5] == ["Saved checkpoint", "Iteration: 20"]
    assert fields[7] == "Floating-point operations: 2.00e+15" and fields[8] == "Tokens (in billions): 0.00"
    # a new 2-GPU job after it starts no new count: the first 2-GPU job's start stays
    assert log._first_start() == (start, 0.0)


def _sharded_params_norm(rank, world_size, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))  # 5 rows: uneven shards
    expected = torch.linalg.vector_norm(torch.cat([p.detach().flatten() for p in model.parameters()])).item()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    lines = []
    logger = TrainLogger(train_iters=4, log_interval=3, global_batch_size=2, world_size=world_size,
                         device=torch.device("cpu"), is_logging_rank=rank == world_size - 1, tokens_per_iteration=8,
                         print_fn=lines.append, params_norm_fn=lambda: params_l2_norm(model),
                         tensorboard_dir=f"{out_dir}/tb", tensorboard_log_interval=2)
    for it in range(1, 5):  # the norm is due at 2 (scalars), 3 (line), 4 (scalars): every rank reduces alike
        logger.record(it, losses={"lm loss": 1.0}, skipped=False, learning_rate=1e-3, grad_norm=0.5,
                      consumed_samples=2 * it)
    logger.close()
    if lines:
        with open(f"{out_dir}/result.txt", "w") as f:
            f.write(f"{parse_train_line(lines[0])['params_norm']} {expected:.3f}")


def test_params_norm_of_fsdp_shards_on_two_ranks_is_the_full_norm(tmp_path):
    from tests.support.launchers import run_distributed

    run_distributed(_sharded_params_norm, 2, str(tmp_path))
    got, expected = (tmp_path / "result.txt").read_text().split()
    assert float(got) == float(expected)
