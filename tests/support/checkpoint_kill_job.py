"""The job tests/e2e/test_checkpoint_kill.py runs in a separate python process and kills: a 1-rank FSDP2 Qwen3
with attention dropout (so RNG restore matters) that resumes from the latest complete checkpoint, trains to
TOTAL_STEPS saving every step with rotation, and writes final.pt.

    python -c "from tests.support.checkpoint_kill_job import train_loop; train_loop(SAVE_DIR)"
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

TOTAL_STEPS = 16


@dataclasses.dataclass
class _State:
    iteration: int = 0
    consumed_samples: int = 0


def train_loop(save_dir: str) -> None:
    """The job: resume if a checkpoint exists, train to TOTAL_STEPS saving every step, write final.pt."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.training.checkpoint import CheckpointManager, load_checkpoint
    from fsdp2_backend.checkpoint.resume_point import resume_point
    from tests.support.launchers import init_one_rank_group
    from tests.support.tiny_models import tiny_qwen3_config

    torch.set_num_threads(1)
    init_one_rank_group()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(attention_dropout=0.2))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    manager = CheckpointManager(save_dir, save_total_limit=2)
    state = _State()
    checkpoint = resume_point(save_dir, None).checkpoint
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, scheduler, state)
        print(f"resumed {state.iteration} from {Path(checkpoint).name}", flush=True)
    while state.iteration < TOTAL_STEPS:
        batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(state.iteration))
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state = _State(state.iteration + 1, state.consumed_samples + 2)
        manager.save(state.iteration, model, optimizer, scheduler, state)
    manager.finalize()
    torch.save(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)),
               Path(save_dir) / "final.pt")
    dist.destroy_process_group()
