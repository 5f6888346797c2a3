"""Global grad norm and clipping over FSDP2 DTensor grads (2 gloo ranks, two meshes) vs a 1-rank run, with
the Megatron loss scaling of loss.py and FSDP's divide factor set to 1 (explicit SUM reductions); also the
chunked loss with the lm head as its own FSDP unit called once per chunk."""
import math
import os
import tempfile

import torch

from fsdp2_backend.training.grad_clip import clip_grad_norm, total_grad_norm
from fsdp2_backend.training.loss import GlobalBatchLoss, chunked_masked_loss_sum, masked_loss_sum
from tests.support.launchers import run_distributed

V, H, S = 13, 8, 6
MAX_NORM = 0.05


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(H, 2 * H), torch.nn.GELU(), torch.nn.Linear(2 * H, H))
        self.norm = torch.nn.LayerNorm(H)
        self.head = torch.nn.Linear(H, V, bias=False)

    def forward(self, tokens, labels=None, mask=None, chunk_size=None):
        h = self.embed(tokens)
        h = self.norm(h + self.mlp(h))
        if chunk_size:  # the loss inside the root's forward, so every FSDP unit is unsharded when called
            return chunked_masked_loss_sum(h, self.head, labels, mask, chunk_size)
        return masked_loss_sum(self.head(h), labels, mask)


def _model():
    torch.manual_seed(0)
    return TinyLM()


def _samples():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (2, S), generator=g)
    labels = torch.randint(0, V, (2, S), generator=g)
    mask = torch.ones(2, S)
    mask[1, 4:] = 0.0  # unequal token counts: the loss modes differ
    return tokens, labels, mask


def _step(model, batches, acc, chunk_size=None):
    for tokens, labels, mask in batches:
        acc.backward_loss(*model(tokens, labels, mask, chunk_size)).backward()
    loss = acc.finish(model.parameters())
    norm = clip_grad_norm(model.parameters(), MAX_NORM).item()
    return loss, norm


def _one_rank(per_token):
    model = _model()
    tokens, labels, mask = _samples()
    batches = [(tokens[i:i + 1], labels[i:i + 1], mask[i:i + 1]) for i in range(2)]
    acc = GlobalBatchLoss(num_microbatches=2, dp_size=1, calculate_per_token_loss=per_token)
    loss, norm = _step(model, batches, acc)
    return loss, norm, {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dp_mesh = init_device_mesh("cpu", (world,))
    hsdp_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    results = {}
    for per_token, chunk_size in ((False, None), (True, None), (False, 4)):
        model = _model()
        fully_shard(model.mlp, mesh=hsdp_mesh)  # another mesh, with a replicated dimension
        fully_shard(model.head, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        for module in (model.mlp, model.head, model):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        tokens, labels, mask = _samples()
        acc = GlobalBatchLoss(num_microbatches=1, dp_size=world, calculate_per_token_loss=per_token,
                              dp_group=dp_mesh.get_group())
        loss, norm = _step(model, [(tokens[rank:rank + 1], labels[rank:rank + 1], mask[rank:rank + 1])], acc,
                           chunk_size)
        inf_norm = total_grad_norm(model.parameters(), float("inf")).item()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[per_token, chunk_size] = (loss, norm, grads, inf_norm)
    if rank == 0:
        torch.save(results, out_path)


def test_fsdp2_two_ranks_match_one_rank_loss_norm_and_clipped_grads():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.pt")
        run_distributed(_worker, 2, out)
        results = torch.load(out)
    for (per_token, chunk_size), (loss, norm, grads, inf_norm) in results.items():
        ref_loss, ref_norm, ref_grads = _one_rank(per_token)
        assert math.isclose(loss, ref_loss, rel_tol=1e-6)
        assert ref_norm > MAX_NORM  # clipping really happened
        assert math.isclose(norm, ref_norm, rel_tol=1e-5), (per_token, norm, ref_norm)
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-8)
        clipped_inf = max(g.abs().max().item() for g in ref_grads.values())
        assert math.isclose(inf_norm, clipped_inf, rel_tol=1e-6)
    # the two loss modes do differ here
    assert not math.isclose(results[False, None][1], results[True, None][1], rel_tol=1e-3)


def test_clip_skips_non_finite_norm_and_leaves_small_grads():
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-4)
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm(model.parameters(), 1.0)
    expected = math.sqrt(sum(p.numel() for p in model.parameters())) * 1e-4
    assert math.isclose(norm.item(), expected, rel_tol=1e-5)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
    model.head.weight.grad[0, 0] = float("nan")
    assert not torch.isfinite(clip_grad_norm(model.parameters(), 1e-6))
    assert torch.equal(model.embed.weight.grad, before[0])  # untouched: the trainer skips this step
