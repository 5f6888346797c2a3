"""The qwen3_next model id on 2 gloo ranks (fp32, the engine's `apply_parallelism`) against one process:
FSDP 2, EP 2 and context parallel 2 (Ulysses and ring: the GDN layers go head-parallel by all_to_all, the
attention layers use Ulysses / ring) give the one-process losses over 8 steps within 1e-4, and the EP 2
checkpoint (DCP, after step 4) continues in one process with the EP 2 run's losses."""
import torch

from tests.support.launchers import run_distributed
from tests.support.qwen3_next_parallel import (SAVE_AFTER, SEQ, STEPS, configure_next, next_config, next_model,
                                               next_optimizer, next_parallel_model)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * (step % 2) + rank)  # two batches in turn: the loss must fall
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    return dict(input_ids=ids, labels=ids, use_cache=False)


def _reference(ranks, steps=STEPS, aux=True):
    """One process: the mean loss of the given ranks' micro-batches per step."""
    config = next_config()
    model = next_model(config, aux)
    configure_next(model, config)
    opt = next_optimizer(model)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = sum(model(**_batch(step, r)).loss for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _train_dp(model, opt, steps, rank):
    import torch.distributed as dist

    losses = []
    for step in steps:
        opt.zero_grad()
        loss = model(**_batch(step, rank)).loss
        (loss / dist.get_world_size()).backward()  # the engine's 1/dp (gradients are SUMmed)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _train_cp(model, opt, steps, ctx, cp_type):
    import torch.distributed as dist
    import torch.nn.functional as F

    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels

    group = ctx.cp_mesh.get_group()
    losses = []
    for step in steps:
        opt.zero_grad()
        full = _batch(step, 0)  # both cp ranks hold pieces of the same sequences
        shard = shard_batch_for_cp(dict(input_ids=full["input_ids"], labels=shift_labels(full["labels"])),
                                   dist.get_rank(group), 2, cp_type)
        logits = model(input_ids=shard["input_ids"], position_ids=shard["position_ids"], use_cache=False).logits
        loss_sum = F.cross_entropy(logits.flatten(0, 1), shard["labels"].flatten(), ignore_index=-100,
                                   reduction="sum")
        loss = cp_token_mean(loss_sum, (shard["labels"] != -100).sum(), group)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append(float(total))
    return losses


def _save(model, opt, ckpt_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)


def _ranks(rank, world_size, out_dir):
    import json

    results = {}
    model, opt, ctx = next_parallel_model(next_config())
    results["fsdp2"] = _train_dp(model, opt, range(STEPS), rank)
    model, opt, ctx = next_parallel_model(next_config(ep_size=2))
    assert model.model.layers[0].mlp.experts.gate_up_proj.to_local().shape[0] == 2  # two experts per rank
    results["ep2"] = _train_dp(model, opt, range(SAVE_AFTER), rank)
    _save(model, opt, f"{out_dir}/ep2")
    results["ep2"] += _train_dp(model, opt, range(SAVE_AFTER, STEPS), rank)
    for cp_type, steps in (("ulysses", STEPS), ("ring", 2)):
        model, opt, ctx = next_parallel_model(next_config(cp_size=2, cp_type=cp_type), aux=False)
        assert model.model.layers[0].linear_attn.context_parallel is not None
        results[cp_type] = _train_cp(model, opt, range(steps), ctx, cp_type)
    if rank == 0:
        with open(f"{out_dir}/losses.json", "w") as f:
            json.dump(results, f)


def _continue_on_one_process(ckpt_dir):
    """The EP 2 checkpoint loaded into the plain one-process model: steps 5..8 on both ranks' batches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    config = next_config()
    model = next_model(config)
    configure_next(model, config)
    opt = next_optimizer(model)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for step in range(SAVE_AFTER, STEPS):
        opt.zero_grad()
        loss = sum(model(**_batch(step, r)).loss for r in range(2)) / 2
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_fsdp_ep_and_cp_equal_one_process_and_ep2_continues_on_one(tmp_path):
    import json

    run_distributed(_ranks, 2, str(tmp_path))
    got = json.loads((tmp_path / "losses.json").read_text())
    dp_reference = _reference(ranks=(0, 1))
    assert dp_reference[-1] < dp_reference[0]  # it trains
    cp_reference = _reference(ranks=(0,), aux=False)
    close = dict(rtol=1e-4, atol=0)
    torch.testing.assert_close(torch.tensor(got["fsdp2"]), torch.tensor(dp_reference), **close)
    torch.testing.assert_close(torch.tensor(got["ep2"]), torch.tensor(dp_reference), **close)
    torch.testing.assert_close(torch.tensor(got["ulysses"]), torch.tensor(cp_reference), **close)
    torch.testing.assert_close(torch.tensor(got["ring"]), torch.tensor(cp_reference[:2]), **close)
    continued = _continue_on_one_process(str(tmp_path / "ep2"))
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(got["ep2"][SAVE_AFTER:]), **close)
