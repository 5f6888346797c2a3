"""deepseek_v4 under context parallel (parallel/context_parallel/dsa_deepseek_v4.py, MindSpeed's kvallgather) against
one process on the same data, in fp32.

A tiny DeepSeek-V4 with a layer of each attention kind (sliding window, compressed sparse attention with its
lightning indexer, heavily compressed attention): 32 tokens, a window of 5, CSA windows of 3 (overlapping, 10
entries) and HCA windows of 5 (6 entries), so windows and compressed entries cross the cp chunks (8 tokens under
ring's head-tail layout), index_topk 3 of 10 entries (the indexer really selects), random sinks, position biases
and indexer weights, the indexer KL loss at coefficient 0.37. One spawn of 2 gloo ranks trains it 4 AdamW steps
(two batches in turn) under cp 2 (ring layout) next to a one-process copy: every step's lm loss and logged indexer
loss within 1e-5 (relative), every step-1 gradient within 1e-5 relative + 1e-6 (indexer, compressors, sinks
included; the indexer's non-zero).
The Ulysses layout (contiguous halves) gives the same first step; packed documents (restarting position ids) are
declined on every rank. The losses are scaled as the trainer scales them (training/loss.py GlobalBatchLoss, and the
indexer loss's backward scale 1 / (micro-batches x dp x cp)). Config validation takes every DeepSeek-V4 layer kind
under cp, checks no Ulysses head split (none is made) and declines packed documents.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.launchers import run_distributed

STEPS, LR, SEQ, COEFF = 4, 3e-3, 32, 0.37


def _config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=96, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, max_position_embeddings=128, o_groups=2, o_lora_rank=8, index_n_heads=2,
        index_head_dim=8, index_topk=3, sliding_window=5, qk_rope_head_dim=8, hc_mult=2, swiglu_limit=0.5,
        compress_rates={"compressed_sparse_attention": 3, "heavily_compressed_attention": 5},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        tie_word_embeddings=False)


def _model():
    from fsdp2_backend.models.deepseek_v4.modeling import build_deepseek_v4
    from fsdp2_backend.models.dsa_indexer_loss import install_deepseek_v4

    torch.manual_seed(0)
    model = build_deepseek_v4(_config())
    model.init_weights()
    with torch.no_grad():  # what the init leaves at 0 or 1 made to matter
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")) or ".indexer." in name:
                p.normal_(0, 0.5)
    assert install_deepseek_v4(model, COEFF) == 1
    return model.train()


def _loss_sum(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss, (labels != -100).sum()


def _full_batch(step):
    from fsdp2_backend.parallel.context_parallel.batch import shift_labels

    ids = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": shift_labels(ids), "position_ids": torch.arange(SEQ).expand(2, -1)}


def _cp_step(model, batch, rank, world_size, cp_type, group):
    """One forward/backward of this rank's share; the summed gradients (FSDP's SUM over the cp ranks), the reported
    lm loss and the logged indexer loss."""
    import torch.distributed as dist

    from fsdp2_backend.models.dsa_indexer_loss import finish_indexer_step, set_backward_scale
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp
    from fsdp2_backend.parallel.router_groups import sum_over

    set_backward_scale(model, 1.0 / world_size)  # the trainer's 1 / (micro-batches x dp x cp)
    local_sum, local_count = _loss_sum(model, shard_batch_for_cp(batch, rank, world_size, cp_type))
    loss = cp_token_mean(local_sum, local_count, group)
    loss.backward()
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=group)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
    return reported.item(), finish_indexer_step(model, sum_over(group))["indexer loss"]


def _ref_step(model):
    from fsdp2_backend.models.dsa_indexer_loss import finish_indexer_step, set_backward_scale

    def step(batch):
        set_backward_scale(model, 1.0)
        loss_sum, count = _loss_sum(model, batch)
        (loss_sum / count).backward()
        return (loss_sum / count).item(), finish_indexer_step(model)["indexer loss"]
    return step


def _assert_grads(model, reference, what):
    for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
        if ref_p.grad is not None:
            torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-6, rtol=1e-5, msg=f"{what} {name}")
    indexer = [p.grad.abs().sum() for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(g > 0 for g in indexer), what  # the KL loss reaches every indexer weight


def _context_parallel(rank, world_size, out_path):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_backend.parallel.context_parallel.dsa import enable_dsa_context_parallel
    from fsdp2_backend.usage_errors import UsageError

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    # ring's head-tail layout: several AdamW steps
    reference, model = _model(), _model()
    assert enable_dsa_context_parallel(model, mesh, "ring")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    ref_step, losses = _ref_step(reference), []
    for step in range(STEPS):
        batch = _full_batch(step % 2)  # two batches in turn: the loss falls as it trains
        ref = ref_step(batch)
        ours = _cp_step(model, batch, rank, world_size, "ring", group)
        losses.append((ours, ref))
        if step == 0:
            _assert_grads(model, reference, "ring")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    results["ring"] = losses
    # Ulysses' contiguous layout: the first step
    reference, model = _model(), _model()
    enable_dsa_context_parallel(model, mesh, "ulysses")
    results["ulysses"] = [(_cp_step(model, _full_batch(0), rank, world_size, "ulysses", group),
                           _ref_step(reference)(_full_batch(0)))]
    _assert_grads(model, reference, "ulysses")
    # packed documents: the position ids restart in the second half (on one rank only under ring's layout)
    packed = _full_batch(0)
    packed["position_ids"] = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(2, -1)
    from fsdp2_backend.parallel.context_parallel.batch import shard_batch_for_cp

    with pytest.raises(UsageError, match="packed documents"):
        _loss_sum(model, shard_batch_for_cp(packed, rank, world_size, "ring"))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_deepseek_v4_cp2_trains_like_one_process(tmp_path):
    out = tmp_path / "results.json"
    run_distributed(_context_parallel, 2, str(out))
    results = json.loads(out.read_text())
    print(json.dumps({k: max(abs(a[0] - b[0]) / b[0] for a, b in v) for k, v in results.items()}))
    assert len(results["ring"]) == STEPS
    for layout, steps in results.items():
        for step, ((lm, indexer), (ref_lm, ref_indexer)) in enumerate(steps):
            assert lm == pytest.approx(ref_lm, rel=1e-5), (layout, step, steps)
            assert indexer == pytest.approx(ref_indexer, rel=1e-5), (layout, step, steps)
            assert indexer > 0
    assert results["ring"][-2][1][0] < results["ring"][0][1][0]  # it trains


def _validation_errors(tmp_path, cp_size, cp_type, **data):
    from fsdp2_backend.config import Config
    from fsdp2_backend.config.validation import validate
    from fsdp2_backend.usage_errors import UsageError

    _config().save_pretrained(str(tmp_path))
    config = Config()
    config.model.model_name_or_path, config.model.model_id = str(tmp_path), "deepseek_v4"
    config.training.stage, config.training.max_steps, config.training.save_checkpoints = "pt", 4, False
    config.data.data_manager_type, config.data.mock_data, config.data.cutoff_len = "mg", True, 64
    for name, value in data.items():
        setattr(config.data, name, value)
    config.parallel.cp_size, config.parallel.cp_type = cp_size, cp_type
    try:
        validate(config, cp_size)
    except UsageError as exc:
        return exc.messages
    return []


def test_validation_takes_every_layer_kind_splits_no_heads_and_declines_packing(tmp_path):
    assert _validation_errors(tmp_path, 2, "ring") == []
    # Ulysses' layout: the queries stay whole-headed (2 heads, cp 4: no head split needed)
    assert _validation_errors(tmp_path, 4, "ulysses") == []
    assert _validation_errors(tmp_path, 2, "ring", reset_position_ids=True) == [
        "parallel.cp_size: model_id deepseek_v4's context parallel takes no packed documents "
        "(data.reset_attention_mask / reset_position_ids / neat_packing) — drop them, or use cp_size 1"]
