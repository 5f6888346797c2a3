"""Expert parallel + expert FSDP on 2 gloo ranks (fp32) against a 1-process run of the same data.

One spawn runs, on the tiny qwen3_moe with FSDP2 + AdamW:
- EP 2 with the eager dispatcher, 8 steps (DCP checkpoint after step 4): loss every step, every gradient
  of step 1 and its norm (computed per mesh, then combined) equal the 1-process reference (the mean of the
  two ranks' micro-batch losses);
- EP 2 with the fused dispatcher: the same losses;
- EP 1 x expert-FSDP 2 (`shard_by_dim_1`), resumed from the EP 2 checkpoint: steps 5-8 continue with the
  EP 2 run's losses (DCP resharded the experts by their global index).
"""
import pytest
import torch

from tests.helpers import run_distributed
from tests.test_qwen3_moe import tiny_moe_config

STEPS, SAVE_AFTER, LR = 8, 4, 5e-3
EXPERTS = "model.layers.{*}.mlp.experts"


def _model():
    from fsdp2_backend.models.qwen3_moe import build_qwen3_moe, configure_moe

    torch.manual_seed(0)
    model = build_qwen3_moe(tiny_moe_config())
    configure_moe(model, moe_grouped_gemm=True, fix_router=False)
    return model


def _micro_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _reference():
    """One process, both ranks' micro-batches in turn: loss = their mean."""
    model = _model()
    opt = _optimizer(model)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = sum(model(**_micro_batch(step, r)).loss for r in range(2)) / 2
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads


def _parallel_model(ep, ep_fsdp, dispatcher):
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    from fsdp2_backend.config import ParallelArguments
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    parallel = ParallelArguments(ep_size=ep, ep_fsdp_size=ep_fsdp, ep_dispatcher=dispatcher, param_dtype="fp32",
                                 ep_modules=[EXPERTS], ep_fsdp_modules=[EXPERTS])
    ctx = ParallelContext.create(parallel)
    model = _model()
    expert_params = apply_expert_parallel(model, SimpleNamespace(parallel=parallel), ctx)
    for layer in model.model.layers:  # the non-expert FSDP, as the engine's FSDP stage does it
        fully_shard(layer, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    fully_shard(model, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    return model


def _train(model, opt, steps, rank):
    import torch.distributed as dist

    losses, grads = [], None
    for step in steps:
        opt.zero_grad()
        loss = model(**_micro_batch(step, rank)).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            grads["norm"] = _grad_norm_by_mesh([p.grad for p in model.parameters()])
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, grads


def _grad_norm_by_mesh(grads):
    """What gradient clipping must do with parameters on two meshes: a norm per mesh, then combined."""
    from torch.distributed.tensor import DTensor

    by_mesh = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    norms = [torch.nn.utils.get_total_norm(gs) for gs in by_mesh.values()]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))


def _ranks(rank, world_size, reference, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import Shard

    ref_losses, ref_grads = reference
    model = _parallel_model(ep=2, ep_fsdp=1, dispatcher="eager")
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64)  # global identity kept
    assert experts.gate_up_proj.placements == (Shard(1), Shard(0))
    assert experts.gate_up_proj.to_local().shape == (2, 64, 64)  # two whole experts per rank
    opt = _optimizer(model)
    eager, grads = _train(model, opt, range(SAVE_AFTER), rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
    eager += _train(model, opt, range(SAVE_AFTER, STEPS), rank)[0]
    torch.testing.assert_close(torch.tensor(eager), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    norm = grads.pop("norm")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(list(ref_grads.values())), rtol=1e-5, atol=0)
    del model, opt

    fused, _ = _train(*_with_opt(_parallel_model(ep=2, ep_fsdp=1, dispatcher="fused")), range(STEPS), rank)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=1e-6, atol=0)

    model, opt = _with_opt(_parallel_model(ep=1, ep_fsdp=2, dispatcher="eager"))
    assert model.model.layers[0].mlp.experts.down_proj.to_local().shape == (4, 32, 32)  # dim 1 sharded
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed, _ = _train(model, opt, range(SAVE_AFTER, STEPS), rank)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(eager[SAVE_AFTER:]), rtol=1e-5, atol=0)


def _with_opt(model):
    return model, _optimizer(model)


def test_expert_parallel_matches_one_process_and_resumes_across_ep_sizes(tmp_path):
    run_distributed(_ranks, 2, _reference(), str(tmp_path / "ckpt"))


def test_mc2_dispatcher_is_a_usage_error_off_npu():
    from fsdp2_backend.errors import UsageError
    from fsdp2_backend.parallel.moe_dispatch import make_dispatcher

    with pytest.raises(UsageError, match="parallel.ep_dispatcher: 'mc2'.*Ascend NPU only"):
        make_dispatcher("mc2", group=None, device_type="cpu")


def test_ep_modules_must_be_stacked_experts():
    from fsdp2_backend.errors import UsageError
    from fsdp2_backend.parallel.expert_parallel import expert_modules

    model = _model()
    assert len(expert_modules(model, [EXPERTS], "parallel.ep_modules")) == 2
    with pytest.raises(UsageError, match="parallel.ep_modules: matches modules that are not stacked MoE experts"):
        expert_modules(model, ["model.layers.{*}.mlp.gate"], "parallel.ep_modules")
