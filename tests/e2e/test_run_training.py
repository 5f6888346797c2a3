"""`build.run_training(config)` end to end on 2 gloo ranks: Megatron's mock GPT data, a tiny Qwen3 HF directory,
Megatron log lines, validation, and a profile written for the chosen steps and rank only."""
import json
import os

import pytest

from fsdp2_backend.config import Config
from fsdp2_backend.config.validation import validate
from fsdp2_backend.usage_errors import UsageError
from tests.support.launchers import run_distributed
from tests.support.save_recorder import SaveRecorder
from tests.support.tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("run_model"), seed=0, num_hidden_layers=1)


def _config(model_dir, profile_dir):
    config = Config()
    config.model.model_name_or_path = model_dir
    config.data.mock_data = True
    config.data.data_manager_type = "mg"
    config.data.cutoff_len = 32
    config.training.stage = "pt"
    config.training.save_checkpoints = False
    config.training.per_device_train_batch_size = 1
    config.training.global_batch_size = 4  # 2 ranks x 1 x 2 micro-batches
    config.training.max_steps = 4
    config.training.lr = 1e-3
    config.training.warmup_ratio = 0.25
    config.training.eval_interval = 2
    config.training.eval_iters = 1
    config.parallel.param_dtype = "fp32"
    config.profiling.profile = True
    config.profiling.profile_ranks = [1]
    config.profiling.profile_step_start = 1
    config.profiling.profile_step_end = 3
    config.profiling.profile_save_path = profile_dir
    return config


def _worker(rank, world_size, model_dir, out_dir):
    from fsdp2_backend.build import run_training

    config = validate(_config(model_dir, os.path.join(out_dir, "profile")), world_size)
    assert config.training.gradient_accumulation_steps == 2
    result = run_training(config)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump({"losses": result.losses, "lrs": result.learning_rates, "valid": result.valid_losses,
                   "state": result.state.state_dict()}, handle)


def test_two_rank_run_logs_like_megatron_and_profiles_the_chosen_window(model_dir, tmp_path, capfd):
    from fsdp2_backend.training.logging import parse_train_line

    run_distributed(_worker, 2, model_dir, str(tmp_path))
    out = capfd.readouterr().out
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the loss is global: every rank reports the same
    result = ranks[0]
    assert result["state"]["iteration"] == 4 and result["state"]["consumed_train_samples"] == 16
    lines = [parse_train_line(line) for line in out.splitlines() if parse_train_line(line)]
    assert [p["iteration"] for p in lines] == [1, 2, 3, 4]  # printed once (by the last rank), every step
    assert all(p["global_batch_size"] == 4 and p["train_iters"] == 4 for p in lines)
    assert [p["losses"]["lm loss"] for p in lines] == pytest.approx(result["losses"], rel=1e-6)
    assert lines[0]["learning_rate"] == pytest.approx(1e-3)  # warmup: 1 of 4 iterations, then decay
    assert [i for i, _ in result["valid"]] == [2, 4, 4]  # every eval_interval, then Megatron's final one
    assert out.count("validation loss at iteration") - out.count("on test set") == 3
    assert out.count(" validation loss at iteration 4 on validation set | lm loss value: ") == 1
    profiles = sorted(os.listdir(tmp_path / "profile"))
    assert profiles == ["rank1_steps1-2.pt.trace.json", "rank1_steps1-2.table.txt"]  # steps 1..2 inclusive
    trace = json.loads((tmp_path / "profile" / profiles[0]).read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}


def test_sft_defaults_need_a_dataset():
    """The seed's defaults (stage sft, data manager lf) are the fine-tuning path (tests/test_sft_*.py): config
    validation, which every run passes before it is built, asks for its dataset."""
    with pytest.raises(UsageError) as declined:
        validate(Config())
    assert "data.dataset: fine-tuning needs a dataset" in str(declined.value)


def test_resume_continues_from_the_restored_state(model_dir, tmp_path):
    """One in-process rank: the state restored from a checkpoint decides where training (and the data)
    continue. A run stopped by exit_interval at iteration 2, restarted with the same command, resumes from its
    checkpoint and ends as the uninterrupted run does."""
    from fsdp2_backend.build import build, run_training
    from fsdp2_backend.checkpoint import dirs
    from fsdp2_backend.training.trainer import Trainer

    def config_for(output_dir, **training):
        config = _config(model_dir, str(tmp_path / "profile"))
        config.profiling.profile = False
        config.training.eval_interval = None
        config.training.save_checkpoints = output_dir is not None
        config.training.output_dir = str(output_dir) if output_dir else None
        for key, value in training.items():
            setattr(config.training, key, value)
        return validate(config, 1)

    straight = run_training(config_for(None))
    assert len(straight.losses) == 4
    stopped = run_training(config_for(tmp_path / "run", exit_interval=2))
    assert stopped.state.iteration == 2 and stopped.losses == pytest.approx(straight.losses[:2], rel=1e-6)
    assert dirs.newest_checkpoint(tmp_path / "run") == tmp_path / "run" / "iter_0000002"

    job = build(config_for(tmp_path / "run"))
    recorder = SaveRecorder()
    try:
        assert (job.state.iteration, job.state.consumed_train_samples) == (2, 8)
        # the schedule continues at iteration 2 (not at the warmup's start, lr_warmup_init 0)
        assert job.optimizer.param_groups[0]["lr"] == pytest.approx(straight.learning_rates[1], rel=1e-6)
        assert job.optimizer.param_groups[0]["lr"] > 0.0
        assert job.loss_scaler.scale == 1.0 and job.tokenizer.vocab_size == 300
        job.checkpointer.close()
        job.checkpointer = recorder
        result = Trainer(job).train()
    finally:
        job.close()
    assert len(result.losses) == 2 and result.state.iteration == 4 and result.state.consumed_train_samples == 16
    assert result.losses == pytest.approx(straight.losses[2:], rel=1e-6)
    assert recorder.saves == [(4, "final")]


def test_num_train_epochs_sets_the_length_from_one_epoch_of_the_train_split(model_dir, tmp_path):
    from fsdp2_backend.data.pretrain import build_pretrain_data
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.data.tokenizer import load_tokenizer
    from fsdp2_backend.build import train_length

    config = _config(model_dir, str(tmp_path))
    config.training.max_steps = -1
    config.training.num_train_epochs = 0.5
    config.training.eval_interval = None
    ctx = ParallelContext.create(config.parallel)
    try:
        tokenizer = load_tokenizer(config.model)
        build = lambda iters: build_pretrain_data(config, tokenizer, 0, 1, 0, 4, 1, iters)  # noqa: E731
        epoch = len(build(1).datasets[0])
        assert epoch > 8
        assert train_length(config, 4, build) == (int(0.5 * epoch) // 4, epoch // 4)
        config.training.num_train_epochs = 1e-9
        with pytest.raises(UsageError, match="training.num_train_epochs"):
            train_length(config, 4, build)
    finally:
        ctx.close()
