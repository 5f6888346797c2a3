"""`--recompute-modules shared_experts` (translated to `model.layers.{*}.mlp.shared_expert`) selects the shared
expert under the name the model gives it: `shared_experts` in DeepSeek-V3, `shared_expert` in Qwen2-MoE — and a
recomputed shared expert still gives the same gradients."""
import functools

import pytest
import torch

pytestmark = pytest.mark.unit

PATTERN = "model.layers.{*}.mlp.shared_expert"  # megatron_compat/translate/recompute.py's translation


def _deepseek():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=32))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32))


def _grads(model, ids):
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_deepseek_shared_experts_are_recomputed_and_gradients_unchanged():
    from fsdp2_backend.parallel.recompute import apply_recompute

    model = _deepseek()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    want = _grads(model, ids)
    assert apply_recompute(model, [PATTERN]) == ["model.layers.1.mlp.shared_experts"]
    assert isinstance(model.model.layers[1].mlp.shared_experts.forward, functools.partial)
    got = _grads(model, ids)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_qwen2_moe_keeps_its_own_spelling():
    from fsdp2_backend.parallel.recompute import apply_recompute

    model = _qwen2_moe()
    assert apply_recompute(model, [PATTERN]) == ["model.layers.0.mlp.shared_expert"]
    assert apply_recompute(_qwen2_moe(), [PATTERN + "s"]) == ["model.layers.0.mlp.shared_expert"]
