"""glm52 (transformers' glm_moe_dsa) under context parallel (MindSpeed's kvallgather,
parallel/context_parallel/dsa_glm.py), against one process on the same data, in fp32.

A tiny GLM-5.2 of three layers: a "full" indexer layer, a "shared" one reusing its top-k, a second "full" one (its
own indexer and KL loss), a dense first MLP and routed + shared experts after; index_topk 5 of 16 tokens, so the
indexer really selects (and the first queries have fewer causal keys than k); the indexer weights drawn large enough
to give spread-out scores. The indexer KL loss (models/dsa_indexer_loss.py) with coefficient 0.37 and the backward
scale the trainer gives it (1 / (micro-batches x data-parallel x cp ranks)).

One spawn of 2 gloo ranks trains it 4 AdamW steps on one batch at cp 2 in ring's head-tail layout (kvallgather's)
and in Ulysses' contiguous layout, next to a one-process copy: the lm loss of every step within 1e-5 (relative), the logged
`indexer loss` equal to the one-process one, every step-1 gradient (the indexers' included) close, and each layer's
selected keys (global positions) those of the one-process run for this rank's queries. Packed rows (restarting
position ids) are declined. Validation accepts glm52 at cp_size 2 (both layouts) and declines packed documents.
Then MindSpeed's glm52 example YAML at cp_size 2 kvallgather trains through pretrain_fsdp2.py with the lm and
indexer losses of its one-rank run.
"""
import json

import pytest
import torch
import torch.nn.functional as F

from tests.support.launchers import run_distributed
from tests.support.newer_ids_yaml import assets  # noqa: F401  (pytest fixture)

STEPS, LR, SEQ, TOPK, COEFF = 4, 3e-3, 16, 5, 0.37


def _config():
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8,
        q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=TOPK, index_head_dim=8,
        index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=128, tie_word_embeddings=False,
        indexer_types=["full", "shared", "full"])


def _model():
    from fsdp2_backend.models.dsa_indexer_loss import install_glm52
    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
    from fsdp2_backend.models.registry import model_spec

    torch.manual_seed(0)
    model = model_spec("glm52").build(_config())
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".indexer." in name and "k_norm" not in name:
                p.normal_(0, 0.3)
    configure_moe(model, moe_grouped_gemm=True, fix_router=False)
    assert install_glm52(model, COEFF) == 2  # the two "full" layers
    return model.train()


def _batch():
    return torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(200))


def _token_loss_sum(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits
    labels = batch["labels"]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
    return loss, (labels != -100).sum()


def _record_topk(model):
    """{layer: top-k indices of its last forward}, filled by forward hooks on the attentions."""
    seen = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
    return seen


def _causal_selection(topk, positions):
    """The selected keys allowed by causality (the rest tie at -inf and may be any), sorted; -1 elsewhere."""
    valid = topk.long() <= positions.view(1, -1, 1)
    return torch.where(valid, topk.long(), -1).sort(dim=-1).values


def _context_parallel(rank, world_size, out_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp2_backend.models.dsa_indexer_loss import finish_indexer_step, set_backward_scale
    from fsdp2_backend.parallel.router_groups import sum_over
    from fsdp2_backend.parallel.context_parallel.batch import (cp_token_mean, sequence_indices, shard_batch_for_cp,
                                                               shift_labels)
    from fsdp2_backend.parallel.context_parallel.dsa import enable_dsa_context_parallel
    from fsdp2_backend.usage_errors import UsageError

    torch.set_num_threads(1)  # two ranks on a small shared CPU
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    group = mesh.get_group()
    results = {}
    for cp_type in ("ring", "ulysses"):
        reference, model = _model(), _model()
        assert enable_dsa_context_parallel(model, mesh, cp_type)
        set_backward_scale(reference, 1.0)
        set_backward_scale(model, 1.0 / world_size)  # the trainer's: 1 / (micro-batches x dp x cp)
        ref_topk, cp_topk = _record_topk(reference), _record_topk(model)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.01)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
        losses = []
        for step in range(STEPS):
            ids = _batch()  # one batch every step: its loss must fall
            full = {"input_ids": ids, "labels": shift_labels(ids)}
            ref_sum, ref_count = _token_loss_sum(reference, full)
            (ref_sum / ref_count).backward()
            ref_indexer = finish_indexer_step(reference)["indexer loss"]
            local = shard_batch_for_cp(full, rank, world_size, cp_type)
            local_sum, local_count = _token_loss_sum(model, local)
            loss = cp_token_mean(local_sum, local_count, group)
            loss.backward()
            indexer = finish_indexer_step(model, sum_over(group))["indexer loss"]  # the plan's: over the dp x cp group
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            for param in model.parameters():  # what FSDP over the cp ranks does: sum the partial gradients
                if param.grad is not None:
                    dist.all_reduce(param.grad)
            losses.append((reported.item(), (ref_sum / ref_count).item(), indexer, ref_indexer))
            if step == 0:
                positions = sequence_indices(SEQ, rank, world_size, cp_type)
                for layer in range(3):
                    assert cp_topk[layer].shape == (2, SEQ // world_size, TOPK)
                    torch.testing.assert_close(_causal_selection(cp_topk[layer], positions),
                                               _causal_selection(ref_topk[layer][:, positions], positions),
                                               msg=f"{cp_type} layer {layer} top-k")
                names = []
                for (name, ref_p), p in zip(reference.named_parameters(), model.parameters()):
                    if ref_p.grad is not None:
                        names.append(name)
                        torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=1e-4, msg=f"{cp_type} {name}")
                assert any(".indexer.wk." in n for n in names) and any(".indexer.wq_b." in n for n in names)
            ref_opt.step(), opt.step()
            ref_opt.zero_grad(), opt.zero_grad()
        results[cp_type] = losses
        # packed rows: the second document restarts its positions on rank 1's tokens
        packed = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(2, -1)
        local = shard_batch_for_cp({"input_ids": _batch(), "position_ids": packed}, rank, world_size, cp_type)
        with pytest.raises(UsageError, match="packed documents"):
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


def test_glm52_cp2_ring_and_ulysses_layouts_train_like_one_process(tmp_path):
    out = tmp_path / "results.json"
    run_distributed(_context_parallel, 2, str(out))
    results = json.loads(out.read_text())
    print(json.dumps({k: max(abs(a - b) / b for a, b, _, _ in v) for k, v in results.items()}))
    for cp_type, losses in results.items():
        assert len(losses) == STEPS
        for step, (ours, ref, indexer, ref_indexer) in enumerate(losses):
            assert ours == pytest.approx(ref, rel=1e-5), (cp_type, step, losses)
            assert indexer > 0 and indexer == pytest.approx(ref_indexer, rel=1e-5), (cp_type, step, losses)
        assert losses[-1][1] < losses[0][1]  # it trains


def test_glm52_validates_at_cp_size_2_and_declines_packed_documents(tmp_path):
    from fsdp2_backend.config import Config
    from fsdp2_backend.config.validation import validate, validate_with_notices
    from fsdp2_backend.usage_errors import UsageError
    from tests.support.tiny_models import save_tiny

    save_tiny("glm52", tmp_path)

    def config(cp_type, **data):
        config = Config()
        config.model.model_name_or_path, config.model.model_id = str(tmp_path), "glm52"
        config.training.stage, config.training.max_steps, config.training.save_checkpoints = "pt", 4, False
        config.data.data_manager_type, config.data.mock_data, config.data.cutoff_len = "mg", True, 64
        for name, value in data.items():
            setattr(config.data, name, value)
        config.parallel.cp_size, config.parallel.cp_type = 2, cp_type
        return config

    _, notices = validate_with_notices(config("kvallgather"), 2)  # raises a UsageError when declined
    assert any(n.startswith("parallel.cp_type: kvallgather for model_id glm52 — each rank's queries over the whole "
                            "sequence's all-gathered MLA key latents") for n in notices), notices
    validate(config("ulysses"), 2)
    with pytest.raises(UsageError, match="model_id glm52's context parallel takes no packed documents"):
        validate(config("kvallgather", reset_position_ids=True), 2)


def _pretrain(assets, out, ranks, *extra):  # noqa: F811
    """MindSpeed's glm52 example YAML (tests/e2e/test_newer_ids_yaml.py's tiny model and data; its recompute on),
    fp32, 2 steps of 2 micro-batches of 2 sequences of 32 tokens through pretrain_fsdp2.py: {iteration: losses}."""
    import os

    from fsdp2_backend.training.logging import parse_train_line
    from tests.support.launchers import failure_report, run_command, train_lines
    from tests.support.newer_ids_yaml import NEWER_IDS_DATA, NEWER_IDS_EXAMPLES, newer_model_args
    from tests.support.launchers import REPO, torchrun_command

    args = [*newer_model_args(assets, "glm52", out), "--training.gradient_accumulation_steps", "2",
            "--parallel.param_dtype", "fp32", "--parallel.fsdp_size", str(ranks), *extra]
    command = torchrun_command(ranks, os.path.join(REPO, "pretrain_fsdp2.py"),
                               str(NEWER_IDS_DATA / NEWER_IDS_EXAMPLES["glm52"]), *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    return {line["iteration"]: line["losses"] for line in train_lines(log, parse_train_line)}, log


def test_mindspeed_glm52_yaml_trains_at_kvallgather_cp2_with_the_one_rank_losses(assets, tmp_path):  # noqa: F811
    """The trainer's own scaling of the indexer loss, FSDP over the two cp ranks (data parallel 1: the one-rank
    run's global batch), recomputed layers (the YAML's) and the validation of cp_size 2."""
    one, log = _pretrain(assets, tmp_path / "one", 1)
    assert sorted(one) == [1, 2], log[-3000:]
    cp2, log = _pretrain(assets, tmp_path / "cp2", 2, "--parallel.cp_size", "2", "--parallel.cp_type", "kvallgather")
    assert sorted(cp2) == [1, 2], log[-3000:]
    for step in (1, 2):
        assert cp2[step]["lm loss"] == pytest.approx(one[step]["lm loss"], rel=1e-5), (step, one, cp2)
        # (a KL of near-uniform distributions: a small number, its last digits rounding)
        assert cp2[step]["indexer loss"] == pytest.approx(one[step]["indexer loss"], rel=1e-4), (step, one, cp2)
    print(json.dumps({"one": one, "cp2": cp2}))
