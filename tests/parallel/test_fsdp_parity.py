"""1 rank vs 2 ranks FSDP2 (gloo), same data and global batch, fp32: lm loss and grad norm per step agree.

This is the test that catches FSDP2's AVG-as-SUM gradient reduction on gloo (pytorch#162338) and any
mistake in Megatron's loss normalisation: micro-batches have different numbers of loss tokens, so a wrong
normalisation changes the numbers. Both Megatron modes are checked (per micro-batch mean, per-token loss).
`parallel.ignored_modules` (whole MLPs and the q norms left out of FSDP, replicated on both ranks): the trainer
reduces their gradients as FSDP would, so the replicas stay identical and equal the 1-rank run's sharded ones.
"""
import json

import pytest
import torch

from fsdp2_backend.config import Config
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.trainer_parity import ConstantLR, masked_samples, rank_micro_batches

STEPS, SEQ, MBS, GBS, VOCAB = 8, 32, 2, 4, 512
IGNORED = ["model.layers.{*}.mlp", "*.q_norm"]


def _is_ignored(name):
    return ".mlp." in name or ".q_norm." in name


def _samples():
    """GBS x STEPS samples with loss masks of varying token counts (deterministic)."""
    return masked_samples(GBS * STEPS, SEQ, seed=11, varying_mask=True)


def _train(model_dir, per_token, world_size, tp=1, cp=1, fsdp_size=1, mbs=MBS, ignored=None, keep=False):
    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism
    from fsdp2_backend.training.trainer import Trainer

    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "fp32"
    config.training.per_device_train_batch_size = mbs
    config.training.calculate_per_token_loss = per_token
    config.training.max_grad_norm = 0.5  # small enough to clip: the clipped update must agree too
    config.parallel.tp_size, config.parallel.cp_size, config.parallel.fsdp_size = tp, cp, fsdp_size
    config.parallel.ignored_modules = ignored
    ctx = ParallelContext.create(config.parallel)
    dp = ctx.dp_size
    assert dp * tp * cp == world_size
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batches = rank_micro_batches(_samples(), dp, ctx.dp_rank, mbs)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=model, optimizer=optimizer, scheduler=ConstantLR(),
                               train_batches=batches, train_iters=STEPS, micro_batches=GBS // (mbs * dp)))
    result = trainer.train()
    out = {"losses": result.losses, "grad_norms": result.grad_norms}
    if keep:  # the final values of the parameters IGNORED names (full tensors), and how far the ranks' differ
        from torch.distributed.tensor import DTensor

        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in model.named_parameters() if _is_ignored(n)}
        if ignored:
            assert not any(isinstance(params[n], DTensor) or isinstance(p, DTensor)
                           for n, p in model.named_parameters() if n in params)  # FSDP left them alone
        ranks = [None] * world_size
        torch.distributed.all_gather_object(ranks, params)
        out["rank_spread"] = max((r[n] - params[n]).abs().max().item() for r in ranks for n in params)
        out["params"] = {n: p.flatten().tolist() for n, p in params.items()}
    ctx.close()
    return out


def _unused_branch_grads(rank):
    """An ignored module whose branch ran on rank 1 only, another that ran nowhere: the reduction still runs on
    both ranks (no hang), the first gets rank 1's gradient on both, the second keeps none (as FSDP's would)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_backend.parallel.replicated_grads import ReplicatedGrads, mark_replicated

    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 2), "branch": torch.nn.Linear(2, 2),
                                 "never": torch.nn.Linear(2, 1)})
    mark_replicated(model, ["used.weight", "branch.weight", "branch.bias", "never.weight"],
                    init_device_mesh("cpu", (2,)))
    x = torch.full((1, 3), float(rank + 1))
    out = model["used"](x)
    if rank == 1:
        out = model["branch"](out)
    out.sum().backward()
    ReplicatedGrads.of(model).all_reduce()
    return {"used": model["used"].weight.grad.tolist(), "branch": model["branch"].weight.grad.tolist(),
            "never": model["never"].weight.grad is None, "unmarked_bias": model["used"].bias.grad.tolist()}


def _worker(rank, world_size, model_dir, out_path):
    results = {mode: _train(model_dir, mode == "per_token", world_size, keep=world_size == 1 and mode == "mean")
               for mode in ("mean", "per_token")}
    if world_size == 2:  # tensor parallel through the same engine (dp 1, tp 2) must agree as well
        results["ignored"] = _train(model_dir, False, world_size, ignored=IGNORED, keep=True)
        branch = [None, None]
        torch.distributed.all_gather_object(branch, _unused_branch_grads(rank))
        results["unused_branch"] = branch
        results["tp2"] = _train(model_dir, False, world_size, tp=2)
        results["cp2"] = _train(model_dir, False, world_size, cp=2)  # Ulysses; mean over the whole sequence
    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump(results, handle)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("parity_model")
    torch.manual_seed(5)
    Qwen3ForCausalLM(tiny_qwen3_config(vocab_size=VOCAB)).save_pretrained(path)
    return str(path)


def test_one_rank_and_two_rank_fsdp_agree_per_step(model_dir, tmp_path):
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    _worker(0, 1, model_dir, str(one))  # the 1-rank reference runs in this process (its own 1-rank group)
    run_distributed(_worker, 2, model_dir, str(two))
    one, two = json.loads(one.read_text()), json.loads(two.read_text())
    for mode, other in (("mean", "mean"), ("per_token", "per_token"), ("mean", "tp2"), ("mean", "cp2"),
                        ("mean", "ignored")):
        for key in ("losses", "grad_norms"):
            a, b = one[mode][key], two[other][key]
            assert len(a) == len(b) == STEPS
            # TP's gradients are reduced in another order (row-parallel partial sums): fp32 noise drifts to ~1e-5
            # over the steps (measured 1.1e-5 at step 4); a scaling fault would be off by a factor.
            rtol = 5e-5 if other == "tp2" else 1e-5
            for step, (x, y) in enumerate(zip(a, b)):
                assert abs(x - y) <= rtol * abs(x), f"{other} {key} step {step}: 1 rank {x} vs 2 ranks {y}"
        assert one[mode]["losses"][-1] < one[mode]["losses"][0]  # it trains
    # The ignored parameters: the same on both ranks, bit for bit, and the 1-rank run's (where FSDP held them)
    assert two["ignored"]["rank_spread"] == 0.0
    reference, replicated = one["mean"]["params"], two["ignored"]["params"]
    assert sorted(reference) == sorted(replicated) and len(reference) == 2 * 4  # 3 MLP weights + q_norm, 2 layers
    for name in reference:
        worst = max(abs(x - y) for x, y in zip(reference[name], replicated[name]))
        assert worst <= 1e-5, f"{name}: 1 rank vs 2 ranks (ignored by FSDP) differ by {worst}"
    # The two modes differ (token counts differ per micro-batch), so the test can tell them apart.
    assert one["mean"]["grad_norms"][0] != pytest.approx(one["per_token"]["grad_norms"][0], rel=1e-4)
    # A branch only one rank ran: its gradient reaches both ranks; a module no rank ran keeps no gradient.
    rank0, rank1 = two["unused_branch"]
    assert rank0["branch"] == rank1["branch"] and any(v != 0 for row in rank0["branch"] for v in row)
    assert rank0["used"] == rank1["used"] and rank0["never"] and rank1["never"]
    assert rank0["unmarked_bias"] != rank1["unmarked_bias"]  # what was not marked is left alone
