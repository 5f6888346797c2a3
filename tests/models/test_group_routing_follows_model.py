"""Group-limited routing follows the model (models/moe/family_swap.py, config/rules/model.py): GLM-5.2 (`glm52`,
transformers' GlmMoeDsa) with 2 expert groups, 1 chosen, top-4 of 16 experts — a case where transformers' group
score (the sum of a group's top 2) and megatron-core's (the top k / group_topk = 4) pick different groups.

- No router field: our model's loss is transformers' own GlmMoeDsaForCausalLM's for the same weights (1e-6, fp32),
  and the same model under megatron-core's rule gives another loss (the case tells the two apart).
- Megatron's group flags (`model.moe_router_num_groups` / `group_topk`, what --moe-router-num-groups /
  --moe-router-group-topk translate to): every layer's routing is megatron-core 0.16.1's `TopKRouter.routing` on that
  layer's logits.
- Validation says once which rule a run takes, only where the two differ.
"""
from dataclasses import replace

import pytest
import torch

from fsdp2_backend.models.moe.family_swap import GROUPED_CLASSES
from fsdp2_backend.models.moe.router import TopKRouter
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from tests.support.router_reference import E, megatron_router
from tests.support.router_reference import megatron  # noqa: F401  (a fixture)

B, S, VOCAB = 2, 12, 96


def _config(**overrides):
    from transformers import GlmMoeDsaConfig

    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=E,
                  num_experts_per_tok=4, n_group=2, topk_group=1, routed_scaling_factor=1.5, n_shared_experts=1,
                  kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                  index_topk=4, index_head_dim=8, index_n_heads=2, first_k_dense_replace=1,
                  max_position_embeddings=128, tie_word_embeddings=False)
    config = GlmMoeDsaConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def _pair():
    """(transformers' GLM-MoE-DSA, ours) in fp32 with the same weights and a random correction bias (it selects)."""
    from transformers import GlmMoeDsaForCausalLM

    config = _config()
    torch.manual_seed(0)
    reference = GlmMoeDsaForCausalLM(config)
    state = {k: (torch.randn_like(v) * 0.05 if k.endswith("e_score_correction_bias") else v)
             for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)
    ours = GROUPED_CLASSES["glm_moe_dsa"](config)
    ours.load_state_dict(state, strict=True)
    return reference.eval(), ours.eval()


def _ids():
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(5))


def test_glm52_two_groups_gives_transformers_loss_and_megatrons_rule_another():
    reference, ours = _pair()
    routers = [m for m in ours.modules() if isinstance(m, TopKRouter)]
    assert [r.settings.group_score_topk for r in routers] == [2]  # transformers' count, not 4 // 1
    ids = _ids()
    with torch.no_grad():
        want = reference(input_ids=ids, labels=ids, use_cache=False).loss
        got = ours(input_ids=ids, labels=ids, use_cache=False).loss
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        for router in routers:  # megatron-core's group score on the same model
            router.apply_settings(replace(router.settings, group_score_topk=None))
        megatron_rule = ours(input_ids=ids, labels=ids, use_cache=False).loss
    assert abs(megatron_rule.item() - want.item()) > 1e-4, (megatron_rule, want)


class _Fields:
    """The config's model.moe_* fields as Megatron's flags set them (the group flags among them)."""

    moe_router_score_function = "sigmoid"
    moe_router_pre_softmax = None
    moe_router_num_groups = 2
    moe_router_group_topk = 1
    moe_router_topk_scaling_factor = 1.5
    moe_router_dtype = None
    moe_z_loss_coeff = None
    moe_router_enable_expert_bias = False
    moe_router_bias_update_rate = 1e-3
    moe_router_load_balancing_type = None
    moe_aux_loss_coeff = 0.0


def test_megatron_group_flags_give_megatron_cores_rule(megatron):
    _, model = _pair()
    configure_moe(model, moe_grouped_gemm=False, fix_router=False, model_args=_Fields)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert [r.settings.group_score_topk for r in routers] == [None]
    seen = []
    for router in routers:
        router.register_forward_hook(lambda m, i, out: seen.append([t.detach() for t in out]))
    with torch.no_grad():
        model(input_ids=_ids(), use_cache=False)
    options = dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=2,
                   moe_router_group_topk=1, moe_router_topk_scaling_factor=1.5, moe_router_enable_expert_bias=True,
                   moe_router_load_balancing_type="none")
    for router, (logits, weights, index) in zip(routers, seen):
        reference = megatron_router(megatron, **options)
        reference.expert_bias.copy_(router.e_score_correction_bias)  # the selection bias megatron-core adds
        probs, routing_map = reference.routing(logits.view(B, S, E).transpose(0, 1).contiguous())
        to_ours = lambda t: t.view(S, B, E).transpose(0, 1).reshape(-1, E)  # noqa: E731
        dense = torch.zeros(B * S, E).scatter(1, index, weights)
        torch.testing.assert_close(dense, to_ours(probs).detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(dense != 0, to_ours(routing_map))


def test_validation_says_which_group_score_once(tmp_path):
    from fsdp2_backend.config.loading import build_config
    from fsdp2_backend.config.validation import validate_with_notices
    from tests.support.tiny_models import train_bytelevel_tokenizer

    path = tmp_path / "glm"
    train_bytelevel_tokenizer(path, vocab_size=VOCAB)
    _config().save_pretrained(str(path))

    def notices(**model):
        config = build_config([("t", {
            "model": {"model_name_or_path": str(path), "model_id": "glm52", **model},
            "data": {"data_manager_type": "mg", "mock_data": True, "cutoff_len": 32},
            "training": {"stage": "pt", "output_dir": str(tmp_path / "out"), "max_steps": 1}})])
        return [n for n in validate_with_notices(config, 1)[1] if "group" in n and "top 2" in n]

    own = notices()
    assert len(own) == 1 and own[0].startswith("model.model_id glm52: group-limited routing (2 groups, 1 chosen) "
                                               "scores each group by the sum of its top 2 scores"), own
    megatron_rule = notices(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_score_function="sigmoid")
    assert len(megatron_rule) == 1 and "sum of its top 4 scores (top-k 4 / 1 groups, megatron-core's rule)" in \
        megatron_rule[0], megatron_rule
    _config(num_experts_per_tok=4, n_group=2, topk_group=2).save_pretrained(str(path))  # 4 // 2 = 2: the same rule
    assert notices() == []
