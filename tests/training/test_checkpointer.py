"""The run's one Checkpointer (fsdp2_backend/training/checkpointer.py): its states saved and loaded, the resume
point obeyed (restart, --finetune, save_checkpoints false), and the HF export when training has finished."""
from __future__ import annotations

import json

import pytest
import torch

from fsdp2_backend.training.loss_scaler import LossScaler
from tests.support.tiny_models import tiny_qwen3_config


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpointer_saves_resumes_finetunes_and_exports(tmp_path):
    """The run's Checkpointer as `build` makes it: a Config and its resume point → save (with the HF export at
    the end of training) and load, with the trainer's real TrainState and LossScaler."""
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.config import Config
    from fsdp2_backend.checkpoint import dirs, resume_point as start
    from fsdp2_backend.training.checkpointer import Checkpointer
    from fsdp2_backend.training.trainer import TrainState

    def build():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_qwen3_config())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def resume_point(config):  # as `fsdp2_backend.build.build` decides it
        training = config.training
        return start.resume_point(training.output_dir if training.save_checkpoints else None,
                                  training.resume_from_checkpoint, config.model.model_name_or_path, training.finetune)

    def checkpointer(config, resume, model, optimizer, scheduler, state, loss_scaler=None):
        return Checkpointer(config, resume, states=dict(model=model, optimizer=optimizer, scheduler=scheduler,
                                                        train_state=state, loss_scaler=loss_scaler),
                            model_config=model.config)

    config = Config()
    config.training.output_dir, config.training.save_total_limit = str(tmp_path / "out"), 1
    config.model.model_name_or_path = str(tmp_path / "hf_weights")  # HF weights: nothing to resume there
    assert resume_point(config) == (None, False, "")
    model, optimizer, scheduler = build()
    state = TrainState(iteration=3, consumed_train_samples=24)
    scaler = LossScaler.for_dtype("fp16")
    scaler.scale = 1024.0
    saver = checkpointer(config, resume_point(config), model, optimizer, scheduler, state, scaler)
    saver.load()  # a fresh run: nothing to restore
    assert (state.iteration, state.consumed_train_samples, scaler.scale) == (3, 24, 1024.0)
    saver.save(3, "interval", train_iters=4)
    assert not (tmp_path / "out" / "hf").exists()  # exported only once training has finished
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    state.iteration, state.consumed_train_samples = 4, 32
    saver.save(4, "exit", train_iters=4)  # an exit at the last iteration has finished training: it exports too
    saver.close()

    out = tmp_path / "out"
    assert [i for i, _ in dirs.complete_checkpoints(out)] == [4]
    assert json.loads((out / "iter_0000004" / "run_config.json").read_text())["training"]["output_dir"] == str(out)
    exported = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    assert torch.equal(exported.lm_head.weight, model.lm_head.weight)

    # The restart of the same command continues; --finetune does not reset a restart.
    config.training.finetune = True
    resume = resume_point(config)
    assert (resume.checkpoint, resume.finetune) == (out / "iter_0000004", False)
    model, optimizer, scheduler = build()
    state, scaler = TrainState(), LossScaler.for_dtype("fp16")
    loader = checkpointer(config, resume, model, optimizer, scheduler, state, scaler)
    loader.load()
    loader.close()
    assert (state.iteration, state.consumed_train_samples, scaler.scale) == (4, 32, 1024.0)
    assert torch.equal(model.lm_head.weight, exported.lm_head.weight)

    # A new run that --load's this one with --finetune (as Megatron's --load, or as the model directory):
    # weights only, counters at 0.
    config.training.output_dir = str(tmp_path / "next")
    for load, model_dir in ((str(out), None), (None, str(out))):
        config.training.resume_from_checkpoint, config.model.model_name_or_path = load, model_dir
        resume = resume_point(config)
        assert (resume.checkpoint, resume.finetune) == (out / "iter_0000004", True)
        model, optimizer, scheduler = build()
        state = TrainState()
        loader = checkpointer(config, resume, model, optimizer, scheduler, state)
        loader.load()
        loader.close()
        assert (state.iteration, state.consumed_train_samples) == (0, 0)
        assert torch.equal(model.lm_head.weight, exported.lm_head.weight)

    # save_checkpoints false (Megatron without --save): saving does nothing, not even the export.
    config.training.save_checkpoints = False
    config.training.output_dir = str(tmp_path / "unsaved")
    config.training.resume_from_checkpoint = config.model.model_name_or_path = None
    idle = checkpointer(config, resume_point(config), model, optimizer, scheduler, TrainState(iteration=1))
    assert idle.manager is None
    idle.save(1, "final", train_iters=1)
    idle.close()
    assert not (tmp_path / "unsaved").exists()
