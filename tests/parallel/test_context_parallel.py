"""Context parallel (Ulysses, ring) on a real HF Qwen3 against the same model on one rank, 2 gloo ranks, fp32."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.config import tp_cp_checks
from fsdp2_backend.parallel.context_parallel import blockwise
from fsdp2_backend.parallel.context_parallel.batch import sequence_indices, shard_batch_for_cp, shift_labels
from tests.support.launchers import run_distributed
from tests.support.tiny_models import tiny_qwen3_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SEQ, BATCH, STEPS = 32, 2, 8


def test_head_tail_indices_cover_sequence_once():
    assert sequence_indices(8, 0, 2, "ring").tolist() == [0, 1, 6, 7]
    assert sequence_indices(8, 1, 2, "ring").tolist() == [2, 3, 4, 5]
    assert sequence_indices(8, 1, 2, "ulysses").tolist() == [4, 5, 6, 7]
    every = torch.cat([sequence_indices(24, r, 3, "ring") for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))


def test_gathered_positions_are_computed_once_per_forward_tensor():
    """Every layer of one forward hands the attention the same position_ids tensor: what is gathered from it is
    computed once (one collective per micro-batch) and again for a new tensor or another group / shape."""
    from fsdp2_backend.parallel.context_parallel.batch import OncePerTensor

    memo, calls = OncePerTensor(), []
    first, second = torch.arange(8)[None], torch.arange(8)[None]
    compute = lambda t: lambda: calls.append(t) or t * 2  # noqa: E731
    for _ in range(3):  # three layers of one forward
        assert torch.equal(memo(first, ("group", 1), compute(first)), first * 2)
    memo(second, ("group", 1), compute(second))  # the next micro-batch: equal values, a new tensor
    memo(second, ("other group", 1), compute(second))
    assert [t is first for t in calls] == [True, False, False]


def test_layout_errors_name_the_numbers():
    with pytest.raises(UsageError) as err:
        tp_cp_checks.check_layout(num_heads=6, num_kv_heads=3, tp_size=4)
    assert "num_attention_heads=6" in str(err.value) and "num_key_value_heads=3" in str(err.value)
    with pytest.raises(UsageError, match="divisible by cp_size=4"):
        tp_cp_checks.check_layout(num_heads=6, num_kv_heads=2, cp_size=4, cp_type="ulysses")
    with pytest.raises(UsageError, match="not divisible by 8"):
        tp_cp_checks.check_layout(num_heads=8, num_kv_heads=8, cp_size=4, cp_type="ring", seq_length=100)
    with pytest.raises(UsageError, match="parallel.cp_type: unknown value 'ulysses_cp_algo'"):
        tp_cp_checks.normalize_cp_type("ulysses_cp_algo")  # Megatron's names end at the front end
    tp_cp_checks.check_layout(num_heads=8, num_kv_heads=1, tp_size=1, cp_size=4, cp_type="ulysses", seq_length=64)


def test_packed_batches_travel_as_position_ids_other_document_marks_are_declined():
    ids = torch.arange(16).view(1, 16)
    packed = {"input_ids": ids, "position_ids": torch.cat([torch.arange(8), torch.arange(8)]).view(1, 16)}
    assert shard_batch_for_cp(packed, 1, 2, "ring")["position_ids"].tolist() == [[4, 5, 6, 7, 0, 1, 2, 3]]
    with pytest.raises(UsageError, match="cu_seqlens"):  # packing: tests/parallel/test_packed_context_parallel.py
        shard_batch_for_cp({**packed, "cu_seqlens": torch.tensor([0, 8, 16])}, 0, 2, "ring")
    shard = shard_batch_for_cp({"input_ids": ids, "labels": shift_labels(ids)}, 1, 2, "ring")
    assert shard["position_ids"].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert shard["labels"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-flash", "math"])
def test_block_backward_with_merged_lse_matches_autograd(kernel, monkeypatch):
    """Two key blocks merged by log-sum-exp give full attention, and per-block backward sums to its gradient."""
    monkeypatch.setattr(blockwise, "_use_cpu_flash", lambda q: kernel)
    torch.manual_seed(0)
    q = torch.randn(1, 4, 6, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(2))
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.3)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    out = torch.zeros(q.shape)
    lse = torch.full(q.shape[:3], float("-inf"))
    halves = (slice(0, 6), slice(6, 12))
    for cols in halves:
        block_out, block_lse = blockwise.block_forward(q.detach(), k.detach()[:, :, cols], v.detach()[:, :, cols],
                                                       False, 0.3)
        blockwise.merge_into(out, lse, block_out, block_lse)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    dq = torch.zeros_like(q)
    for cols in halves:
        bq, bk, bv = blockwise.block_backward(dout, q.detach(), k.detach()[:, :, cols], v.detach()[:, :, cols], out,
                                              lse, False, 0.3)
        dq += bq
        torch.testing.assert_close(bk, k.grad[:, :, cols], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(bv, v.grad[:, :, cols], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dq, q.grad, atol=1e-5, rtol=1e-5)


def token_loss_sum(model, batch):
    """Sum of per-token cross entropies over aligned labels, and the number of counted tokens."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss, (labels != -100).sum()


def _cp_worker(rank, world_size, cases, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    for cp_type, kv_heads, steps, attention in cases:
        torch.manual_seed(0)
        config = tiny_qwen3_config(num_key_value_heads=kv_heads, attn_implementation=attention)
        reference = Qwen3ForCausalLM(config)
        # its own config object: enable_context_parallel switches the model's attention implementation
        model = Qwen3ForCausalLM(tiny_qwen3_config(num_key_value_heads=kv_heads, attn_implementation=attention))
        model.load_state_dict(reference.state_dict())
        enable_context_parallel(model, mesh, cp_type)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        worst_loss, worst_grad = 0.0, 0.0
        for step in range(steps):
            ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
            full = {"input_ids": ids, "labels": shift_labels(ids)}
            ref_sum, ref_count = token_loss_sum(reference, full)
            ref_loss = ref_sum / ref_count
            ref_loss.backward()
            local_sum, local_count = token_loss_sum(model, shard_batch_for_cp(full, rank, world_size, cp_type))
            loss = cp_token_mean(local_sum, local_count, group)
            loss.backward()
            reported = loss.detach().clone()
            dist.all_reduce(reported, group=group)
            for param in model.parameters():  # what FSDP/DDP over the cp ranks does: sum the partial gradients
                dist.all_reduce(param.grad, group=group)
            worst_loss = max(worst_loss, abs(reported.item() - ref_loss.item()) / ref_loss.item())
            if step == 0:
                assert abs(reported.item() - ref_loss.item()) < 1e-5, (cp_type, reported.item(), ref_loss.item())
                for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
                    worst_grad = max(worst_grad, (ref_p.grad - p.grad).abs().max().item())
                    torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=0, msg=f"{cp_type} {name}")
            ref_opt.step(), opt.step()
            ref_opt.zero_grad(), opt.zero_grad()
        assert worst_loss < 1e-4, (cp_type, kv_heads, worst_loss)
        results[f"{cp_type}/kv{kv_heads}/{attention}"] = {"max_rel_loss_diff": worst_loss,
                                                          "max_grad_diff": worst_grad}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_cp2_matches_one_rank_for_ulysses_and_ring(tmp_path):
    """Loss of step 1 within 1e-5, every parameter gradient within 1e-5, 8 AdamW steps within 1e-4 relative.

    kv heads 1 < cp 2 exercises Ulysses' key/value replication and ring's GQA expansion; a model built with
    eager attention exercises Ulysses' inner attention for it.
    """
    out = tmp_path / "cp.json"
    cases = [("ulysses", 2, STEPS, "sdpa"), ("ring", 2, STEPS, "sdpa"), ("ulysses", 2, 1, "eager")]
    run_distributed(_cp_worker, 2, cases, str(out))
    results = json.loads(out.read_text())
    assert len(results) == 3, results
    print(json.dumps(results))


def _fsdp_cp_worker(rank, world_size, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean

    # dp 1 x cp 2 with FSDP sharding over the cp ranks (as torchtitan's dp_shard x cp flattening)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_cp",))
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(tiny_qwen3_config())
    model = Qwen3ForCausalLM(tiny_qwen3_config())
    model.load_state_dict(reference.state_dict())
    enable_context_parallel(model, mesh, "ring")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # sum, not average: each rank's loss is already divided by the global token count; force SUM
            # collectives because gloo has no PREMUL_SUM (and its AVG is unreliable, pytorch#162338)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    ids = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    full = {"input_ids": ids, "labels": shift_labels(ids)}
    ref_sum, ref_count = token_loss_sum(reference, full)
    (ref_sum / ref_count).backward()
    loss = cp_token_mean(*token_loss_sum(model, shard_batch_for_cp(full, rank, world_size, "ring")), mesh.get_group())
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    assert abs(reported.item() - (ref_sum / ref_count).item()) < 1e-5
    for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), ref_p.grad, atol=1e-5, rtol=0, msg=name)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"loss": reported.item()}, f)


def test_fsdp_sharded_over_cp_ranks_sums_gradients_to_the_one_rank_ones(tmp_path):
    """FSDP2 over the cp ranks with gradient divide factor 1 + cp_token_mean = the one-rank loss and gradients."""
    out = tmp_path / "fsdp_cp.json"
    run_distributed(_fsdp_cp_worker, 2, str(out))
    assert "loss" in json.loads(out.read_text())
