"""Multi-token prediction layouts in tests: an in-process trainer with MTP layers (`mtp_trainer`), its batches, the
full state of a model, the HF export round trip, and written-out reference maths (zero-centred RMSNorm, partial
RoPE, SwiGLU) the layout tests compare against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fsdp2_backend.config import Config

SEQ, MBS, FACTOR = 12, 2, 0.3


def mtp_trainer(path, model_id, mtp_layers=1):
    from fsdp2_backend.build import TrainJob, _with_mtp
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.optimizer import build_optimizer
    from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path, config.model.model_id = str(path), model_id
    config.model.mtp_num_layers, config.model.mtp_loss_scaling_factor = mtp_layers, FACTOR
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = MBS
    config.training.max_steps, config.training.lr, config.training.lr_scheduler_type = 2, 1e-3, "constant"
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(*_with_mtp(m, config, config.model), ctx))
    optimizer = build_optimizer(model, lr=config.training.lr, weight_decay=0.0)
    scheduler = ParamScheduler(optimizer, **scheduler_steps(config.training, MBS))

    def batches():
        while True:
            yield mtp_batch(model.config.vocab_size)

    job = TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=scheduler,
                   train_batches=batches(), train_iters=2, micro_batches=1)
    return Trainer(job), ctx


def mtp_batch(vocab, seed=1):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randint(0, vocab, (MBS, SEQ + 1), generator=gen)
    mask = torch.ones(MBS, SEQ)
    mask[1, 4] = 0
    return dict(tokens=text[:, :-1], labels=text[:, 1:], loss_mask=mask,
                position_ids=torch.arange(SEQ).expand(MBS, SEQ))


def full_state(model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in state.items()}  # on one CPU rank these may share the live parameters' storage


# ------------------------------------------------------------------------------------------ plain references
def assert_export_round_trip(export, prefix, mtp, state, model_id):
    """The export at `export` holds exactly the checkpoint's MTP tensors `mtp` under their published names (the
    keys starting with `prefix`), and loading it back into `model_id` gives `state` bit for bit."""
    from safetensors.torch import load_file

    on_disk = {}
    for shard in export.glob("*.safetensors"):
        on_disk.update(load_file(shard))
    written = {k: v for k, v in on_disk.items() if k.startswith(prefix)}
    assert sorted(written) == sorted(mtp)  # the published names, nothing else
    for key, tensor in mtp.items():
        assert torch.equal(written[key], tensor), key
    again, ctx = mtp_trainer(export, model_id)
    try:
        reloaded = full_state(again.model)
    finally:
        ctx.close()
    assert sorted(reloaded) == sorted(state)
    for key, tensor in state.items():
        assert torch.equal(reloaded[key], tensor), key


def zero_centered_rms(x, w, eps):  # Qwen3-Next's zero-centred RMSNorm: the stored weight w is applied as 1 + w
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def partial_rope(x, pos, theta, rotary_dim):  # x [B, S, heads, d]; rotary on the first rotary_dim dims
    freqs = pos[..., None].float() / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = torch.cat([-rot[..., rotary_dim // 2:], rot[..., :rotary_dim // 2]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def swiglu(x, gate, up, down):
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T
