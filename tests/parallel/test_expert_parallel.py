"""Expert parallel + expert FSDP on 2 gloo ranks (fp32) against a 1-process run of the same data.

One spawn runs, on the tiny qwen3_moe with FSDP2 + AdamW:
- EP 2 with the eager dispatcher, 8 steps (DCP checkpoint after step 4): loss every step, every gradient
  of step 1 and its norm (`training.grad_clip.total_grad_norm` over both meshes) equal the 1-process reference (the mean of the
  two ranks' micro-batch losses);
- EP 2 with the fused dispatcher, recomputed layers (the all-to-alls run again in backward) and the
  trainer's gradient scheme (SUM reduction, loss / dp): the same losses;
- the gathered full state dict of the EP 2 model loaded into transformers' own Qwen3-MoE gives the same loss;
- EP 1 x expert-FSDP 2 (`shard_by_dim_1`), resumed from the EP 2 checkpoint, continues with the EP 2 run's
  losses, and an EP 2 run resumed from its checkpoint after step 6 too (DCP reshards experts by global index).
A second, 4-rank run checks EP 2 x expert-FSDP 2 against the 1-process reference for 2 steps.
"""
import pytest
import torch

from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_moe_config

STEPS, SAVE_AFTER, LR = 8, 4, 5e-3
EXPERTS = "model.layers.{*}.mlp.experts"


def _model():
    from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe, configure_moe

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


def _reference(world_size=2, steps=STEPS):
    """One process, every rank's micro-batch in turn: loss = their mean."""
    model = _model()
    opt = _optimizer(model)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(**_micro_batch(step, r)).loss for r in range(world_size)) / world_size
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads


def _parallel_model(ep, ep_fsdp, dispatcher, recompute=False):
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
    if recompute:  # the engine's order: EP, then recompute, then FSDP
        from fsdp2_backend.parallel.recompute import apply_recompute

        apply_recompute(model, ["model.layers.{*}"])
    for layer in model.model.layers:  # the non-expert FSDP, as the engine's FSDP stage does it
        fully_shard(layer, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    fully_shard(model, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    # The engine's one gradient policy: every FSDP unit (expert ones included) SUMs; the loss carries 1/dp.
    from fsdp2_backend.parallel.apply import set_gradient_policy

    set_gradient_policy(model)
    return model


def _train(model, opt, steps, rank):
    import torch.distributed as dist

    from fsdp2_backend.training.grad_clip import total_grad_norm

    losses, grads = [], None
    for step in steps:
        opt.zero_grad()
        loss = model(**_micro_batch(step, rank)).loss
        (loss / dist.get_world_size()).backward()  # the 1/dp of the engine's loss normaliser
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            grads["norm"] = total_grad_norm(model.parameters())  # expert and non-expert meshes together
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, grads


def _resume(model, opt, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _save(model, opt, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)


def _check_full_state_dict_is_transformers(model, rank):
    """The gathered weights, loaded into transformers' own Qwen3-MoE, give this model's loss (every expert in
    its place)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import Qwen3MoeForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        loss = model(**_micro_batch(99, rank)).loss
    if rank == 0:
        stock = Qwen3MoeForCausalLM(tiny_moe_config())
        stock.load_state_dict(full, strict=True)
        with torch.no_grad():
            torch.testing.assert_close(stock(**_micro_batch(99, 0)).loss, loss, rtol=1e-5, atol=0)


def _ranks(rank, world_size, reference, ckpt_dir):
    from torch.distributed.tensor import Shard

    ref_losses, ref_grads = reference
    model, opt = _with_opt(_parallel_model(ep=2, ep_fsdp=1, dispatcher="eager"))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 64, 64)  # global identity kept
    assert experts.gate_up_proj.placements == (Shard(1), Shard(0))
    assert experts.gate_up_proj.to_local().shape == (2, 64, 64)  # two whole experts per rank
    eager, grads = _train(model, opt, range(SAVE_AFTER), rank)
    _save(model, opt, f"{ckpt_dir}/ep2")
    eager += _train(model, opt, range(SAVE_AFTER, STEPS), rank)[0]
    torch.testing.assert_close(torch.tensor(eager), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    norm = grads.pop("norm")
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(norm, torch.nn.utils.get_total_norm(list(ref_grads.values())), rtol=1e-5, atol=0)
    _check_full_state_dict_is_transformers(model, rank)
    del model, opt

    model, opt = _with_opt(_parallel_model(ep=2, ep_fsdp=1, dispatcher="fused", recompute=True))
    fused, _ = _train(model, opt, range(STEPS), rank)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(eager), rtol=1e-5, atol=0)

    # EP 2 → EP 1 x expert-FSDP 2 (dim 1 sharded) → back to EP 2, through DCP.
    model, opt = _with_opt(_parallel_model(ep=1, ep_fsdp=2, dispatcher="eager"))
    assert model.model.layers[0].mlp.experts.down_proj.to_local().shape == (4, 32, 32)
    _resume(model, opt, f"{ckpt_dir}/ep2")
    resumed, _ = _train(model, opt, range(SAVE_AFTER, SAVE_AFTER + 2), rank)
    _save(model, opt, f"{ckpt_dir}/ep1")
    resumed += _train(model, opt, range(SAVE_AFTER + 2, STEPS), rank)[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(eager[SAVE_AFTER:]), rtol=1e-5, atol=0)
    model, opt = _with_opt(_parallel_model(ep=2, ep_fsdp=1, dispatcher="fused"))
    _resume(model, opt, f"{ckpt_dir}/ep1")
    back, _ = _train(model, opt, range(SAVE_AFTER + 2, STEPS), rank)
    torch.testing.assert_close(torch.tensor(back), torch.tensor(eager[SAVE_AFTER + 2:]), rtol=1e-5, atol=0)


def _with_opt(model):
    return model, _optimizer(model)


def test_expert_parallel_matches_one_process_and_resumes_across_ep_sizes(tmp_path):
    run_distributed(_ranks, 2, _reference(), str(tmp_path / "ckpt"))


def _ranks_ep_and_expert_fsdp(rank, world_size, reference):
    from torch.distributed.tensor import Shard

    model, opt = _with_opt(_parallel_model(ep=2, ep_fsdp=2, dispatcher="fused"))
    weight = model.model.layers[1].mlp.experts.gate_up_proj
    assert weight.device_mesh.mesh_dim_names == ("ep_fsdp", "ep")
    assert weight.placements == (Shard(1), Shard(0)) and weight.to_local().shape == (2, 32, 64)
    losses, grads = _train(model, opt, range(len(reference[0])), rank)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=0)
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight"):
        torch.testing.assert_close(grads[name], reference[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_expert_parallel_with_expert_fsdp_on_four_ranks():
    """EP 2 x expert-FSDP 2: experts split over `ep` and each expert's rows over `ep_fsdp` (gloo has no
    PREMUL_SUM, so this also checks the expert units' sum-then-divide reduction)."""
    run_distributed(_ranks_ep_and_expert_fsdp, 4, _reference(world_size=4, steps=2))


def test_mc2_dispatcher_is_a_usage_error_off_npu():
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.parallel.moe_dispatch import make_dispatcher

    with pytest.raises(UsageError, match="parallel.ep_dispatcher: 'mc2'.*Ascend NPU only"):
        make_dispatcher("mc2", group=None, device_type="cpu")


def test_ep_modules_must_be_stacked_experts():
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.parallel.expert_parallel import expert_modules

    model = _model()
    assert len(expert_modules(model, [EXPERTS], "parallel.ep_modules")) == 2
    with pytest.raises(UsageError, match="parallel.ep_modules: matches modules that are not stacked MoE experts"):
        expert_modules(model, ["model.layers.{*}.mlp.gate"], "parallel.ep_modules")


def test_layouts_that_would_reduce_wrongly_are_refused():
    """Checked before any mesh is touched (ctx is not needed to refuse)."""
    from types import SimpleNamespace

    from fsdp2_backend.config import ParallelArguments
    from fsdp2_backend.usage_errors import UsageError
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    def apply(**fields):
        apply_expert_parallel(_model(), SimpleNamespace(parallel=ParallelArguments(**fields)), ctx=None)

    with pytest.raises(UsageError, match=r"parallel.ep_fsdp_modules: model.layers.0.mlp, .* hold non-expert"):
        apply(ep_size=2, ep_fsdp_modules=["model.layers.{*}.mlp"])
