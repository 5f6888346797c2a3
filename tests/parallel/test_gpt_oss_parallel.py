"""gpt_oss under the parallel layouts, on 2 gloo ranks (fp32), against one process on the same data.

One spawn runs, on a tiny GPT-OSS (sliding + full layers, window 4 over 16 tokens, sinks far from zero):
- context parallel 2, Ulysses and ring: the loss of 2 AdamW steps, and every gradient of step 1 (sinks included)
  equal the one-process model's — windows crossing the cp chunks, sinks on each rank's heads;
- EP 2 with the fused dispatcher and recomputed layers, 8 steps (DCP checkpoint after step 4): loss every step
  within 1e-5 of the one-process run (the mean of the two ranks' micro-batch losses), step-1 gradients too;
- EP 1 x expert-FSDP 2, resumed from the EP 2 checkpoint, continues with the same losses.
Then, in this process (world size 1, no process group), the EP 2 checkpoint continues at 1 rank with the
reference's losses. Reference: the same model code without any parallel stage (itself equal to transformers'
GPT-OSS: tests/models/test_gpt_oss.py).
"""
import json

import torch
import torch.nn.functional as F

from tests.support.launchers import run_distributed

STEPS, SAVE_AFTER, LR, SEQ = 8, 4, 5e-3, 16
EXPERTS = "model.layers.{*}.mlp.experts"


def tiny_config():
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=64,
                        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
                        use_cache=False)  # as the trainer runs it (a cache would grow under recompute)


def _model():
    from fsdp2_backend.models.gpt_oss.modeling import build_gpt_oss
    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe

    torch.manual_seed(0)
    model = build_gpt_oss(tiny_config())
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0)
    configure_moe(model, moe_grouped_gemm=True, fix_router=False)
    return model


def _micro_batch(step, rank):
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))
    return dict(input_ids=ids, labels=ids)


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)


def _reference(world_size=2, steps=STEPS):
    model = _model()
    opt = _optimizer(model)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(**_micro_batch(step, r)).loss for r in range(world_size)) / world_size
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads


def _token_loss_sum(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss, (labels != -100).sum()


def _context_parallel(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    results = {}
    for cp_type in ("ulysses", "ring"):
        reference, model = _model(), _model()
        enable_context_parallel(model, mesh, cp_type)
        ref_opt, opt = _optimizer(reference), _optimizer(model)
        worst = 0.0
        for step in range(2):
            ids = _micro_batch(step, 0)["input_ids"]
            full = {"input_ids": ids, "labels": shift_labels(ids)}
            ref_sum, ref_count = _token_loss_sum(reference, full)
            (ref_sum / ref_count).backward()
            local_sum, local_count = _token_loss_sum(model, shard_batch_for_cp(full, rank, world_size, cp_type))
            loss = cp_token_mean(local_sum, local_count, mesh.get_group())
            loss.backward()
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            for param in model.parameters():  # what FSDP over the cp ranks does: sum the partial gradients
                if param.grad is not None:
                    dist.all_reduce(param.grad)
            worst = max(worst, abs(reported.item() - (ref_sum / ref_count).item()))
            if step == 0:
                for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
                    if ref_p.grad is not None:
                        torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=1e-5, msg=f"{cp_type} {name}")
                sinks = model.model.layers[0].self_attn.sinks.grad
                assert sinks.abs().max() > 1e-4  # the sinks do get a gradient through CP
            ref_opt.step(), opt.step()
            ref_opt.zero_grad(), opt.zero_grad()
        assert worst < 1e-5, (cp_type, worst)
        results[cp_type] = worst
    return results


def _parallel_model(ep, ep_fsdp, dispatcher, recompute=False):
    from types import SimpleNamespace

    from torch.distributed.fsdp import fully_shard

    from fsdp2_backend.config import ParallelArguments
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.parallel.apply import set_gradient_policy
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    parallel = ParallelArguments(ep_size=ep, ep_fsdp_size=ep_fsdp, ep_dispatcher=dispatcher, param_dtype="fp32",
                                 ep_modules=[EXPERTS], ep_fsdp_modules=[EXPERTS])
    ctx = ParallelContext.create(parallel)
    model = _model()
    expert_params = apply_expert_parallel(model, SimpleNamespace(parallel=parallel), ctx)
    if recompute:  # the engine's order: EP, then recompute, then FSDP
        from fsdp2_backend.parallel.recompute import apply_recompute

        apply_recompute(model, ["model.layers.{*}"])
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    fully_shard(model, mesh=ctx.fsdp_mesh, ignored_params=expert_params)
    set_gradient_policy(model)
    return model


def _train(model, opt, steps, rank):
    import torch.distributed as dist

    losses, grads = [], None
    for step in steps:
        opt.zero_grad()
        loss = model(**_micro_batch(step, rank)).loss
        (loss / dist.get_world_size()).backward()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses, grads


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _resume(model, opt, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _state(model, opt)
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _ranks(rank, world_size, reference, ckpt_dir, out_path):
    import torch.distributed.checkpoint as dcp

    results = {"cp_max_loss_diff": _context_parallel(rank, world_size)}
    ref_losses, ref_grads = reference
    model = _parallel_model(ep=2, ep_fsdp=1, dispatcher="fused", recompute=True)
    opt = _optimizer(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0] == 2  # two experts per rank
    ep2, grads = _train(model, opt, range(SAVE_AFTER), rank)
    dcp.save(_state(model, opt), checkpoint_id=f"{ckpt_dir}/ep2")
    ep2 += _train(model, opt, range(SAVE_AFTER, STEPS), rank)[0]
    torch.testing.assert_close(torch.tensor(ep2), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    del model, opt

    model = _parallel_model(ep=1, ep_fsdp=2, dispatcher="eager")
    opt = _optimizer(model)
    _resume(model, opt, f"{ckpt_dir}/ep2")
    resumed, _ = _train(model, opt, range(SAVE_AFTER, STEPS), rank)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref_losses[SAVE_AFTER:]), rtol=1e-5, atol=0)
    results["ep2_max_rel_loss_diff"] = max(abs(a - b) / b for a, b in zip(ep2, ref_losses))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_cp_ep_and_expert_fsdp_match_one_process_and_ep2_continues_at_one_rank(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    reference = _reference()
    out = tmp_path / "results.json"
    run_distributed(_ranks, 2, reference, str(tmp_path), str(out))
    print(out.read_text())

    # The EP 2 checkpoint (experts sharded over 2 ranks) continues at world size 1, no process group.
    model = _model()
    opt = _optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(tmp_path / "ep2"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for step in range(SAVE_AFTER, STEPS):
        opt.zero_grad()
        loss = sum(model(**_micro_batch(step, r)).loss for r in range(2)) / 2
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0][SAVE_AFTER:]), rtol=1e-5, atol=0)
