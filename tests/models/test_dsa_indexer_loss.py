"""The DSA indexer's KL loss (models/dsa_indexer_loss.py): its value against a sequential loop written from the
documented formula (MindSpeed's compute_dsa_indexer_loss: per-head softmax over the selected keys, summed over heads
and L1-normalised, against the softmax of the index scores over the same keys, mean over queries, times the
coefficient), and in a tiny DeepSeek-V4 (one compressed-sparse-attention layer): the indexer's weights get a gradient
scaled as the trainer asks, every other gradient is the lm loss's alone."""
import math

import pytest
import torch

from fsdp2_backend.models.dsa_indexer_loss import (
    finish_indexer_step, indexer_kl_loss, install_deepseek_v4, install_glm52, set_backward_scale)

COEFF = 0.37


def _oracle(index_scores, topk, query, key, scale, coeff):
    b_n, h_n, s_n, _ = query.shape
    total = 0.0
    for b in range(b_n):
        for s in range(s_n):
            keys = [int(j) for j in topk[b, s] if j >= 0]
            if not keys:
                continue
            target = {j: 0.0 for j in keys}
            for h in range(h_n):
                logits = {j: float(query[b, h, s] @ key[b, j]) * scale for j in keys}
                top = max(logits.values())
                norm = sum(math.exp(v - top) for v in logits.values())
                for j in keys:
                    target[j] += math.exp(logits[j] - top) / norm
            total_target = sum(target.values())
            top = max(float(index_scores[b, s, j]) for j in keys)
            norm = sum(math.exp(float(index_scores[b, s, j]) - top) for j in keys)
            for j in keys:
                p = target[j] / total_target
                r = math.exp(float(index_scores[b, s, j]) - top) / norm
                total += p * (math.log(p) - math.log(r))
    return coeff * total / (b_n * s_n)


@pytest.mark.parametrize("block_rows", [None, 2])  # None: every query in one block; 2: blocks of 2, 2 and 1 queries
def test_kl_loss_matches_a_sequential_loop(block_rows, monkeypatch):
    from fsdp2_backend.models import dsa_indexer_loss

    torch.manual_seed(3)
    b, h, s, t, d, k = 2, 3, 5, 6, 4, 3
    if block_rows:
        monkeypatch.setattr(dsa_indexer_loss, "_TARGET_BLOCK", b * h * t * block_rows)
    query, key = torch.randn(b, h, s, d, dtype=torch.float64), torch.randn(b, t, d, dtype=torch.float64)
    scores = torch.randn(b, s, t, dtype=torch.float64, requires_grad=True)
    topk = torch.stack([torch.randperm(t)[:k] for _ in range(b * s)]).view(b, s, k)
    topk[0, 0] = -1        # a query with no selected key contributes 0
    topk[1, 2, 1:] = -1    # fewer valid keys than k
    loss = indexer_kl_loss(scores, topk, query, key, 0.5, COEFF)
    assert loss.item() == pytest.approx(_oracle(scores.detach(), topk, query, key, 0.5, COEFF), rel=1e-5)
    loss.backward()
    assert torch.isfinite(scores.grad).all() and scores.grad[0, 0].abs().sum() == 0


def _tiny_v4():
    from fsdp2_backend.models.deepseek_v4.modeling import build_deepseek_v4
    from tests.support.tiny_models import tiny_newer_config

    config = tiny_newer_config("deepseek_v4")  # layer 0 is compressed sparse attention
    torch.manual_seed(0)
    model = build_deepseek_v4(config)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "indexer" in name:
                p.normal_(0, 0.3)  # non-trivial index scores
    return model


def _grads(model, ids, scale=None):
    model.train()
    model.zero_grad(set_to_none=True)
    if scale is not None:
        set_backward_scale(model, scale)
    out = model(input_ids=ids, use_cache=False)
    out.logits.float().logsumexp(-1).mean().backward()  # any lm-side loss
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def test_deepseek_v4_indexer_is_trained_and_nothing_else_changes():
    plain = _tiny_v4()
    hooked = _tiny_v4()
    assert install_deepseek_v4(hooked, COEFF) == 1
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    base = _grads(plain, ids)
    once = _grads(hooked, ids, scale=1.0)
    logged = finish_indexer_step(hooked)
    assert list(logged) == ["indexer loss"] and logged["indexer loss"] > 0
    assert finish_indexer_step(hooked) == {}  # reset after the step
    twice = _grads(hooked, ids, scale=2.0)
    assert finish_indexer_step(hooked) == pytest.approx(logged)  # the scale moves the gradient, not the value
    indexer = [n for n in base if ".indexer." in n]
    assert indexer
    for name in base:
        if name in indexer:
            assert base[name].abs().sum() == 0, name      # transformers: no gradient into the indexer
            torch.testing.assert_close(twice[name], 2 * once[name])
        else:
            torch.testing.assert_close(once[name], base[name], rtol=0, atol=0, msg=name)
    assert sum(once[n].abs().sum() for n in indexer) > 0
    # evaluation: nothing attached, nothing logged
    hooked.eval()
    hooked(input_ids=ids, use_cache=False)
    assert finish_indexer_step(hooked) == {}


def test_glm52_indexer_is_trained_and_nothing_else_changes():
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    from fsdp2_backend.models.dsa_indexer_loss import glm_index_scores
    from fsdp2_backend.models.moe.family_swap import build
    from tests.support.tiny_models import tiny_newer_config

    def tiny():
        torch.manual_seed(0)
        model = build(tiny_newer_config("glm52"))
        model.init_weights()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".indexer." in name:
                    p.normal_(0, 0.3)
        return model

    plain, hooked = tiny(), tiny()
    assert install_glm52(hooked, COEFF) == 2
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    # the recomputed scores select what transformers' indexer selects
    seen = {}
    layer = hooked.model.layers[0].self_attn
    handle = layer.indexer.register_forward_hook(lambda m, a, o: seen.update(args=a, topk=o))
    hooked.eval()
    hooked(input_ids=ids, use_cache=False)
    handle.remove()
    hidden, q_resid, (cos, sin), mask = seen["args"][:4]
    mine = glm_index_scores(layer.indexer, hidden, q_resid, cos, sin)
    mine = mine.masked_fill(~mask, -1e30) if mask.dtype == torch.bool else mine + mask
    # (masked keys tie at the mask's minimum: any of them may fill a short row)
    torch.testing.assert_close(mine.topk(seen["topk"].shape[-1], dim=-1).values.clamp(min=-1e4),
                               mine.gather(-1, seen["topk"].long()).clamp(min=-1e4))
    base = _grads(plain, ids)
    once = _grads(hooked, ids, scale=1.0)
    logged = finish_indexer_step(hooked)
    assert logged["indexer loss"] > 0
    twice = _grads(hooked, ids, scale=2.0)
    finish_indexer_step(hooked)
    indexer = [n for n in base if ".indexer." in n]
    for name in base:
        if name in indexer:
            assert base[name].abs().sum() == 0, name
            torch.testing.assert_close(twice[name], 2 * once[name])
        else:
            torch.testing.assert_close(once[name], base[name], rtol=0, atol=0, msg=name)
    assert all(once[n].abs().sum() > 0 for n in indexer if "k_norm" not in n), indexer
    assert isinstance(layer, glm.GlmMoeDsaAttention)
