"""Packed documents (position ids restarting at each document, `kernels/varlen.py`) under context parallel 2 equal
the same packed batch on one rank, 2 gloo ranks, fp32:
- the attention functions: ring (blockwise, per-document mask from the global positions; with and without a
  sliding window) and Ulysses (the whole sequence's position ids gathered for the packed attention, from an SDPA
  model and from a `neat_packing` one) against SDPA with an explicit block-diagonal causal mask built from the
  document lengths — values and the q/k/v gradients of every shard;
- a tiny Qwen3 (transformers' own model: its cp-1 reference reads the documents from the position ids) and the
  qwen3_next model id (Gated DeltaNet layers resetting their state at document starts) trained at cp 2, Ulysses
  and ring, over a few steps;
- end to end: a tiny Llama pretrained from Megatron flags on short EOD-separated documents with
  --reset-position-ids --reset-attention-mask gives the cp-1 losses at cp 2 (Ulysses and ring) within 1e-4.
All cases of the first three run in one 2-rank launch.
"""
from __future__ import annotations

import json
import os

import numpy
import torch
import torch.nn.functional as F

from tests.support.launchers import run_distributed, run_pretrain
from tests.support.tiny_models import tiny_qwen3_config
from tests.support.sft_assets import assets as sft_assets  # noqa: F401  (pytest fixture)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
SEQ, SCALE = 16, 0.3
# Two rows of 16: documents end inside ring / Ulysses chunks and on their edges; in row 0 the Ulysses rank 1 holds
# no restart (one rank sees packed positions, the other does not); row 1's last document starts a chunk.
LENGTHS = ([3, 13], [5, 3, 8])


def _positions(lengths=LENGTHS) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def _reference_attention(q, k, v, window=None):
    """SDPA with a boolean [b, 1, s, s] mask: causal inside each document (from LENGTHS), optional window."""
    b, h, s, _ = q.shape
    mask = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for i, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            mask[i, 0, start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
            start += n
    if window:
        diff = torch.arange(s)[:, None] - torch.arange(s)[None, :]
        mask &= diff < window
    groups = h // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=mask, scale=SCALE)


def _qkv(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, SEQ, 8, generator=g)
    k, v = (torch.randn(2, 2, SEQ, 8, generator=g) for _ in range(2))
    return q, k, v, torch.randn(2, 4, SEQ, 8, generator=g)


def _check_function(name, run_shard, index, window=None, seed=0):
    """run_shard(q, k, v, position_ids) → this rank's output [b, h, s_local, d]; checked against the reference."""
    q, k, v, dout = _qkv(seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference_attention(*leaves, window=window)
    ref.backward(dout)
    shards = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = run_shard(*shards, _positions()[:, index])
    out.backward(dout[:, :, index])
    torch.testing.assert_close(out, ref.detach()[:, :, index], atol=1e-5, rtol=1e-5, msg=name)
    worst = (out - ref.detach()[:, :, index]).abs().max().item()
    for label, shard, leaf in zip("qkv", shards, leaves):
        torch.testing.assert_close(shard.grad, leaf.grad[:, :, index], atol=1e-5, rtol=1e-5,
                                   msg=f"{name} d{label}")
        worst = max(worst, (shard.grad - leaf.grad[:, :, index]).abs().max().item())
    return worst


def _model_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                           reduction="sum"), (batch["labels"] != -100).sum()


def _qwen3_case(cp_type, rank, world_size, mesh, steps=2, neat_packing=False):
    """Transformers' Qwen3: cp 2 on the packed batch (its SDPA, or the packed attention of `neat_packing`) vs
    one rank with SDPA (transformers reads the documents from the position ids); losses, step-1 gradients."""
    import torch.distributed as dist
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.models.packed_attention import enable_packed_attention
    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels

    group = mesh.get_group()
    torch.manual_seed(0)
    reference = Qwen3ForCausalLM(tiny_qwen3_config(num_key_value_heads=2))
    model = Qwen3ForCausalLM(tiny_qwen3_config(num_key_value_heads=2))
    model.load_state_dict(reference.state_dict())
    if neat_packing:
        enable_packed_attention(model)
    enable_context_parallel(model, mesh, cp_type)
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model))
    worst = 0.0
    for step in range(steps):
        ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(step))
        full = {"input_ids": ids, "labels": shift_labels(ids), "position_ids": _positions()}
        ref_sum, ref_count = _model_loss(reference, full)
        (ref_sum / ref_count).backward()
        loss = cp_token_mean(*_model_loss(model, shard_batch_for_cp(full, rank, world_size, cp_type)), group)
        loss.backward()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=group)
        for param in model.parameters():
            dist.all_reduce(param.grad, group=group)
        worst = max(worst, abs(reported.item() - (ref_sum / ref_count).item()))
        if step == 0:
            for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
                torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=0, msg=f"{cp_type} {name}")
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert worst < 1e-5, (cp_type, worst)
    return worst


def _qwen3_next_case(cp_type, steps=2):
    """The qwen3_next model id through `apply_parallelism` at cp 2 vs one process, on the packed batch."""
    import torch.distributed as dist

    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels
    from tests.support.qwen3_next_parallel import (configure_next, next_config, next_model, next_optimizer,
                                                   next_parallel_model)

    config = next_config(cp_size=2, cp_type=cp_type)
    reference = next_model(next_config())
    configure_next(reference, next_config())
    ref_opt = next_optimizer(reference)
    model, opt, ctx = next_parallel_model(config)
    group = ctx.cp_mesh.get_group()
    worst = 0.0
    for step in range(steps):
        ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(step))
        full = {"input_ids": ids, "labels": shift_labels(ids), "position_ids": _positions()}
        ref_sum, ref_count = _model_loss(reference, full)
        ref_loss = ref_sum / ref_count
        ref_loss.backward()
        loss = cp_token_mean(*_model_loss(model, shard_batch_for_cp(full, dist.get_rank(group), 2, cp_type)),
                             group)
        loss.backward()
        reported = loss.detach().clone()
        dist.all_reduce(reported, group=group)
        worst = max(worst, abs(reported.item() - ref_loss.item()))
        ref_opt.step(), opt.step()
        ref_opt.zero_grad(), opt.zero_grad()
    assert worst < 1e-4, (cp_type, worst)
    return worst


def _worker(rank, world_size, out_path):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.models.packed_attention import enable_packed_attention
    from fsdp2_backend.parallel.context_parallel.attention import context_parallel_attention, enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import sequence_indices
    from fsdp2_backend.parallel.context_parallel.ring import ring_attention

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    ring_index = sequence_indices(SEQ, rank, world_size, "ring")
    for window in (None, 5):
        results[f"ring/window{window}"] = _check_function(
            f"ring window {window}", lambda q, k, v, pos, w=window: ring_attention(q, k, v, SCALE, group, window=w,
                                                                                   position_ids=pos),
            ring_index, window=window)
    for packed in (False, True):  # the model's own attention: SDPA (pretraining) or the packed one (neat_packing)
        model = Qwen3ForCausalLM(tiny_qwen3_config(num_attention_heads=4, num_key_value_heads=2))
        if packed:
            enable_packed_attention(model)
        enable_context_parallel(model, mesh, "ulysses")
        module = model.model.layers[0].self_attn

        def ulysses(q, k, v, pos, module=module):
            out, _ = context_parallel_attention(module, q, k, v, None, scaling=SCALE, position_ids=pos)
            return out.transpose(1, 2)  # [b, s_local, h, d] → [b, h, s_local, d]

        results[f"ulysses/{'packed' if packed else 'sdpa'}"] = _check_function(
            f"ulysses packed={packed}", ulysses, sequence_indices(SEQ, rank, world_size, "ulysses"), seed=1)
    for cp_type in ("ulysses", "ring"):
        results[f"qwen3/{cp_type}"] = _qwen3_case(cp_type, rank, world_size, mesh)
        results[f"qwen3_next/{cp_type}"] = _qwen3_next_case(cp_type)
    results["qwen3/ring/neat_packing"] = _qwen3_case("ring", rank, world_size, mesh, neat_packing=True)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_packed_documents_under_cp2_equal_one_rank(tmp_path):
    """Worst absolute differences: attention outputs / gradients within 1e-5, Qwen3 losses within 1e-5 (and every
    step-1 gradient), qwen3_next losses within 1e-4."""
    out = tmp_path / "packed_cp.json"
    run_distributed(_worker, 2, str(out))
    results = json.loads(out.read_text())
    assert len(results) == 9, results
    print(json.dumps(results))


# -- end to end: Megatron flags, short documents, --reset-position-ids --reset-attention-mask -------------------
VOCAB = 127  # NullTokenizer: ids 0..126, EOD 127
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 1 --tokenizer-type NullTokenizer --swiglu --normalization RMSNorm "
         "--disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--attention-dropout 0 --hidden-dropout 0 --log-interval 1 --eval-iters 0 --split 100,0,0 "
         "--reset-position-ids --reset-attention-mask --eod-mask-loss").split() + ["--vocab-size", str(VOCAB)]


def _short_documents(prefix: str) -> str:
    """Documents of 2..11 tokens each ending in EOD (several per 32-token sample), by our IndexedDatasetBuilder."""
    from megatron_compat.data.indexed_dataset import IndexedDatasetBuilder

    rng = numpy.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.uint16)
    for _ in range(200):
        tokens = rng.integers(0, VOCAB, int(rng.integers(2, 12)))
        tokens[-1] = VOCAB  # EOD
        builder.add_item(torch.from_numpy(tokens))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def test_llama_pretraining_with_reset_attention_mask_cp2_equals_cp1(tmp_path):
    prefix = _short_documents(str(tmp_path / "docs"))
    flags = FLAGS + ["--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")]
    one, _ = run_pretrain(flags, tmp_path / "cp1")
    assert sorted(one) == [1, 2, 3, 4]
    # the documents matter: without the two flags (attention across documents, positions running on) it differs
    across, _ = run_pretrain([f for f in flags if f not in ("--reset-position-ids", "--reset-attention-mask")],
                             tmp_path / "across")
    assert max(abs(float(across[i][1]) - float(one[i][1])) for i in one) > 1e-3, (across, one)
    for algo in ("ulysses_cp_algo", "megatron_cp_algo"):  # Ulysses, ring
        cp2, log = run_pretrain(flags + ["--context-parallel-size", "2", "--context-parallel-algo", algo],
                                tmp_path / algo, ranks=2)
        assert sorted(cp2) == [1, 2, 3, 4], log[-3000:]
        for it in one:
            assert cp2[it][0] == one[it][0]
            assert abs(float(cp2[it][1]) - float(one[it][1])) < 1e-4, (algo, it, cp2[it], one[it])
        print(algo, "max |cp2 - cp1| lm loss:", max(abs(float(cp2[i][1]) - float(one[i][1])) for i in one),
              "(without the flags:", max(abs(float(across[i][1]) - float(one[i][1])) for i in one), ")")


def test_packed_documents_in_sliding_windows_need_ring(tmp_path):
    """Validation (before any process group): Ulysses' windowed attention (the sink attention over the gathered
    sequence) takes no documents, so packed documents with sliding-window layers ask for ring; ring passes."""
    from fsdp2_backend.config import Config
    from fsdp2_backend.config.validation import validate
    from fsdp2_backend.usage_errors import UsageError

    config = tiny_qwen3_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    config.save_pretrained(str(tmp_path))
    line = "parallel.cp_type: packed documents (data.reset_attention_mask / reset_position_ids) in sliding-window"
    for cp_type in ("ulysses", "ring"):
        run = Config()
        run.model.model_name_or_path = str(tmp_path)
        run.data.reset_position_ids, run.data.data_manager_type, run.data.mock_data = True, "mg", True
        run.training.stage, run.training.output_dir = "pt", str(tmp_path / "out")
        run.parallel.cp_size, run.parallel.cp_type = 2, cp_type
        try:
            validate(run, world_size=2)
            errors = ""
        except UsageError as error:
            errors = str(error)
        assert (line in errors) == (cp_type == "ulysses"), (cp_type, errors)


def test_neat_packing_sft_with_ring_cp2_equals_one_rank(sft_assets, tmp_path):  # noqa: F811
    """SFT packed rows (`neat_packing`) under ring cp 2 = one rank (the Ulysses case: tests/e2e/test_sft_training.py)."""
    from tests.support.sft_assets import losses_close, run_sft, sft_losses, sft_yaml

    data = {"neat_packing": True, "cutoff_len": 128}
    training = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 1}
    one = sft_yaml(sft_assets, "packed_one", data, training)
    ring = sft_yaml(sft_assets, "packed_ring2", data, training, {"cp_size": 2, "cp_type": "ring"})
    lines1, _ = run_sft(one, tmp_path / "one", ranks=1)
    lines2, log2 = run_sft(ring, tmp_path / "ring2", ranks=2)
    assert sorted(lines2) == [1, 2, 3, 4], log2[-3000:]
    losses_close(sft_losses(lines2), sft_losses(lines1))
