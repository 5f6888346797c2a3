"""megatron-core 0.16.1 as the reference run the resume tests continue: its training stack (DDP, its optimizer and
scheduler) and step on CPU (`CpuForCuda`: what megatron-core creates on "cuda" lands on the CPU), its GPTDataset,
a checkpoint saved as Megatron-LM saves one (`save_like_megatron_lm`), the run's flags for our engine
(`resume_flags`), and the readers of our printed steps and exported weights."""
from __future__ import annotations

import random
import re

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from tests.support.megatron_checkpoints import SEQ, VOCAB
from tests.support.megatron_reference import IdsTokenizer

GBS, K, T, SEED = 2, 3, 5, 1234
LR, MIN_LR, WARMUP, WD, CLIP = 1e-3, 1e-4, 2, 0.1, 1.0


# Megatron's log line with the learning rate: iteration, consumed samples, learning rate, lm loss.
LOG_LINE = re.compile(r" iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|.*? learning rate: (\S+) \|"
                      r".*? lm loss: (\S+) \|")


class CpuForCuda(TorchFunctionMode):
    """Puts the tensors megatron-core's optimizer creates on "cuda" on the CPU, and lets its fp32 gradient-type
    assertion see a CUDA type name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def megatron_gpt_dataset(prefix, cache):
    """megatron-core's GPTDataset over the indexed corpus `prefix` (T * GBS samples, its cache under `cache`)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=SEED, sequence_length=SEQ, blend=([prefix], None), split="100,0,0",
                              tokenizer=IdsTokenizer(vocab_size=VOCAB, eod=VOCAB - 1), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=cache)
    return BlendedMegatronDatasetBuilder(GPTDataset, [T * GBS, 0, 0], lambda: True, config).build()[0]


def megatron_training_stack(model, distributed_optimizer: bool, **ddp_options):
    """megatron-core's own DDP, optimizer (torch AdamW) and scheduler over `model`, with this file's settings;
    call inside `_CpuForCuda`. `ddp_options`: more DistributedDataParallelConfig fields (bucket size, ...)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer, **ddp_options), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=CLIP, use_distributed_optimizer=distributed_optimizer), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR,
                                        lr_warmup_steps=WARMUP * GBS, lr_decay_steps=T * GBS,
                                        lr_decay_style="cosine", start_wd=WD, end_wd=WD, wd_incr_steps=T * GBS,
                                        wd_incr_style="constant")
    return ddp, optimizer, scheduler


def megatron_training_step(ddp, optimizer, scheduler, batch) -> float:
    """One megatron-core iteration on `batch` (tokens, labels, loss_mask, position_ids): the loss before it."""
    mask = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = ddp(batch["tokens"], batch["position_ids"], attention_mask=mask, labels=batch["labels"])
    loss = (losses.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    ddp.finish_grad_sync()
    assert optimizer.step()[0]
    scheduler.step(increment=GBS)
    return loss.item()


def save_like_megatron_lm(root, fmt, model, optimizer, scheduler, args, dist_checkpointing, ShardedObject):
    """Megatron-LM's save_checkpoint, reduced to one rank: the same keys in the same files."""
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    it_dir = root / f"iter_{K:07d}"
    common = {"args": args, "checkpoint_version": 3.0, "iteration": K, "opt_param_scheduler": scheduler.state_dict(),
              "num_floating_point_operations_so_far": 0}
    if fmt == "torch_dist":
        metadata = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
        model_sd = model.sharded_state_dict(metadata=metadata)
        it_dir.mkdir(parents=True)
        dist_checkpointing.save({**common, "model": model_sd,
                                 "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
                                 "rng_state": ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=0)},
                                str(it_dir))
    elif fmt == "fsdp_dtensor":  # Megatron-FSDP's layout (test_megatron_fsdp_dtensor.py), from megatron-core's state
        from tests.support.megatron_checkpoints import fsdp_dtensor_save

        names = {param: name for name, param in model.named_parameters()}
        state = {names[p]: st for o in getattr(optimizer, "chained_optimizers", [optimizer])
                 for p, st in o.optimizer.state.items()}
        fsdp_dtensor_save(it_dir, args, model, K, state, scheduler.state_dict(), rng)
    elif fmt == "torch_dcp":  # CheckpointType.GLOBAL: torch.distributed.checkpoint.save of the legacy dict
        from torch.distributed.checkpoint import FileSystemWriter, save

        it_dir.mkdir(parents=True)
        save({**common, "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
              "rng_state": [rng]}, storage_writer=FileSystemWriter(str(it_dir)))
    else:
        (it_dir / "mp_rank_00").mkdir(parents=True)
        torch.save({**common, "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                    "rng_state": [rng]}, it_dir / "mp_rank_00" / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(K))
    return rng


def resume_flags(root, prefix, *extra, mbs=GBS):
    """Our engine's flags to continue the reference run saved under `root`/mg: the same data and schedule."""
    return ["--load", str(root / "mg"), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1),
            "--data-path", prefix, "--split", "100,0,0", "--data-cache-path", str(root / "cache"),
            "--seq-length", str(SEQ), "--micro-batch-size", str(mbs), "--global-batch-size", str(GBS),
            "--train-iters", str(T), "--lr", str(LR), "--min-lr", str(MIN_LR), "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(WARMUP), "--weight-decay", str(WD), "--clip-grad", str(CLIP),
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--seed", str(SEED),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
            *extra]


def printed_steps(log):
    """{iteration: (consumed samples, learning rate, lm loss)} of the Megatron log lines in `log`."""
    return {int(it): (int(consumed), float(lr), float(loss)) for it, consumed, lr, loss in LOG_LINE.findall(log)}


def hf_weights(directory):
    """Every tensor of the safetensors files of an HF directory."""
    from safetensors.torch import load_file

    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def save_like_megatron_lm_distopt(root, sharding, rank, model, optimizer, scheduler, args, dist_checkpointing,
                           ShardedObject):
    """Megatron-LM's save_checkpoint: the same keys in the same files; `dp_reshardable` is what `--ckpt-format
    torch_dist` writes by default, `fully_reshardable` what `--dist-ckpt-optim-fully-reshardable` writes."""
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}
    it_dir = root / f"iter_{K:07d}"
    metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    model_sd = model.sharded_state_dict(metadata=metadata)
    if rank == 0:
        it_dir.mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save({"args": args, "checkpoint_version": 3.0, "iteration": K,
                             "opt_param_scheduler": scheduler.state_dict(), "num_floating_point_operations_so_far": 0,
                             "model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, metadata=metadata),
                             "rng_state": ShardedObject("rng_state", [rng], (1, 1), (0, 0), replica_id=rank)},
                            str(it_dir))
    if rank == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(K))
