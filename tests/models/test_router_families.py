"""The project's router and stacked experts on the deepseek_v3, mixtral and qwen2_moe families
(`models/moe/family_swap.py`).

- With no router field set, each family's model equals transformers' own for the same weights: logits, loss
  (with transformers' aux loss where the family has one), aux loss and every gradient — DeepSeek-V3 with a
  non-zero `e_score_correction_bias` that changes the selection, group-limited routing and a scaling factor.
- With Megatron's options, every layer's routing in the model equals megatron-core 0.16.1's `TopKRouter.routing`
  on that layer's logits (the reference harness of `test_router_megatron`): probabilities, routing map, every
  logged loss; `aux_loss` is their weighted sum; DeepSeek-V3's correction bias is the expert bias and moves as
  megatron-core's `_update_router_expert_bias` moves it.
- Megatron flags without --qk-layernorm (a Mixtral): expert parallel 2 prints the one-rank losses (1e-4).
"""
import pytest
import torch

from fsdp2_backend.models.moe.router import TopKRouter, finish_router_step
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from tests.support.launchers import run_pretrain
from tests.support.router_reference import E, ROUTER_CASES, megatron_router
from tests.support.router_reference import megatron  # noqa: F401  (a fixture)
from tests.support.router_reference import B, S, RouterFields, family_ids, family_pair


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral", "qwen2_moe"])
def test_defaults_equal_transformers_model(family):
    reference, ours = family_pair(family)
    assert all(type(m).__name__ == "GroupedExperts" for n, m in ours.named_modules() if n.endswith("mlp.experts"))
    assert sum(isinstance(m, TopKRouter) for m in ours.modules()) == 2 - (family == "deepseek_v3")
    ids = family_ids()
    outs = [model(input_ids=ids, labels=ids, use_cache=False) for model in (reference, ours)]
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-6, atol=1e-7)
    if family != "deepseek_v3":  # transformers' aux loss, from our routers' logits
        assert outs[0].aux_loss is not None
        torch.testing.assert_close(outs[1].aux_loss, outs[0].aux_loss, rtol=1e-6, atol=1e-7)
    for out in outs:
        out.loss.backward()
    grads = dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


FAMILY_CASES = [("deepseek_v3", "groups_sigmoid_bias"), ("deepseek_v3", "sigmoid_bias_scaling"),
                ("deepseek_v3", "softmax_aux"), ("mixtral", "sinkhorn_k2"), ("mixtral", "pre_softmax_seq_aux_z"),
                ("qwen2_moe", "two_losses"), ("qwen2_moe", "global_aux")]
# Options a field leaves unset keep the family's own routing; for DeepSeek-V3 (sigmoid, 4 groups of which 2, scaling
# 2.0 in `tiny_family_config`) megatron-core is given those explicitly. Its softmax case asks for softmax.
DEEPSEEK_OWN = dict(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                    moe_router_topk_scaling_factor=2.0)


@pytest.mark.parametrize("family, case", FAMILY_CASES)
def test_model_routing_equals_megatron_core(megatron, family, case):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    options = dict(ROUTER_CASES[case], moe_router_topk=4)
    if family == "deepseek_v3":
        options = {**DEEPSEEK_OWN, **({"moe_router_score_function": "softmax"} if case == "softmax_aux" else {}),
                   **options}
    _, model = family_pair(family)
    configure_moe(model, moe_grouped_gemm=False, fix_router=False, model_args=RouterFields(options))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    seen = []
    for router in routers:
        router.register_forward_hook(lambda m, i, out: seen.append([t.detach() for t in out]))
    out = model(input_ids=family_ids(), use_cache=False)
    if family == "deepseek_v3" and options.get("moe_router_enable_expert_bias"):
        assert all(r.expert_bias is r.e_score_correction_bias for r in routers)
    expected_aux = 0.0
    for router, (logits, weights, index) in zip(routers, seen):
        reference = megatron_router(megatron, **options)
        if router.settings.expert_bias:
            reference.expert_bias.copy_(router.expert_bias)
        clear_aux_losses_tracker()
        ref_probs, ref_map = reference.routing(logits.view(B, S, E).transpose(0, 1).contiguous())
        to_ours = lambda t: t.view(S, B, E).transpose(0, 1).reshape(-1, E)  # noqa: E731
        dense = torch.zeros(B * S, E).scatter(1, index, weights)
        torch.testing.assert_close(dense, to_ours(ref_probs).detach(), rtol=1e-5, atol=1e-6)
        assert torch.equal(dense != 0, to_ours(ref_map))
        tracked = {name: v["values"][0] for name, v in get_moe_layer_wise_logging_tracker().items()
                   if v["values"].abs().sum() > 0}
        assert set(tracked) == set(router.logged)
        for name, value in tracked.items():
            torch.testing.assert_close(router.logged[name], value, rtol=1e-5, atol=1e-8, msg=name)
            coeffs = dict(router.settings.load_balancing, z_loss=router.settings.z_loss_coeff)
            kind = {"load_balancing_loss": "aux_loss", "seq_load_balancing_loss": "seq_aux_loss",
                    "global_load_balancing_loss": "global_aux_loss"}.get(name, name)
            expected_aux = expected_aux + value * coeffs[kind]
        if router.settings.expert_bias:  # the bias update after the step, as finalize_model_grads does it
            from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

            reference.config.moe_router_bias_update_rate = options.get("moe_router_bias_update_rate", 1e-3)
            _update_router_expert_bias([reference], reference.config)
            router._expected_bias = reference.expert_bias.clone()
    if isinstance(expected_aux, torch.Tensor):
        torch.testing.assert_close(out.aux_loss.detach(), expected_aux, rtol=1e-5, atol=1e-8)
    else:
        assert getattr(out, "aux_loss", None) is None
    if routers[0].settings.expert_bias:
        finish_router_step(model, num_microbatches=1)
        for router in routers:
            torch.testing.assert_close(router.e_score_correction_bias if family == "deepseek_v3"
                                       else router.expert_bias, router._expected_bias, rtol=0, atol=0)
        if family == "deepseek_v3":  # saved under transformers' name, where checkpoints and exports keep it
            assert not any(k.endswith(".expert_bias") for k in model.state_dict())


FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --group-query-attention "
         "--num-query-groups 2 --seq-length 32 --max-position-embeddings 64 --micro-batch-size 2 "
         "--global-batch-size 4 --train-iters 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
         "--lr-warmup-iters 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --swiglu "
         "--normalization RMSNorm --disable-bias-linear --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0 --log-interval 1 "
         "--eval-iters 0 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
         "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
         "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001").split()


def test_mixtral_expert_parallel_2_equals_one_rank(tmp_path):
    import json
    import re

    pattern = re.compile(r" iteration\s+(\d+)/.*? lm loss: (\S+) \| z_loss: (\S+) \| seq_load_balancing_loss: (\S+)")
    runs = []
    for name, extra, ranks in (("one", (), 1), ("ep2", ("--expert-model-parallel-size", "2"), 2)):
        _, log = run_pretrain(FLAGS, tmp_path / name, *extra, ranks=ranks)
        config = json.loads((tmp_path / name / "iter_0000004" / "run_config.json").read_text())
        assert (config["model"]["model_id"], config["model"]["architecture"]["model_type"]) == ("mixtral", "mixtral")
        runs.append({int(it): tuple(map(float, v)) for it, *v in pattern.findall(log)})
    assert sorted(runs[0]) == sorted(runs[1]) == [1, 2, 3, 4]
    for it in runs[0]:
        assert runs[1][it] == pytest.approx(runs[0][it], rel=1e-4), (it, runs[0][it], runs[1][it])


# -- Megatron / MindSpeed flags on these families -------------------------------------------------------------------
MLA = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 64 "
       "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type "
       "NullTokenizer --vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
       "--position-embedding-type rope --hidden-dropout 0 --multi-latent-attention --kv-lora-rank 16 --qk-head-dim 16 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 16 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
       "--moe-shared-expert-intermediate-size 32").split()


def _validated(argv):
    from fsdp2_backend.config import GROUPS, Config
    from fsdp2_backend.config import validation
    from megatron_compat.translate import translate_megatron

    translation = translate_megatron(argv)
    config = Config(**{group: GROUPS[group](**values) for group, values in translation.fields.items()})
    return validation.validate(config, 1), translation


def test_deepseek_flags_from_scratch_are_megatron_defaults_not_transformers():
    """No router flag: Megatron's softmax scores, every layer MoE, no groups, no scaling (transformers' DeepSeek-V3
    defaults would be sigmoid, 3 dense layers, 8 groups, 2.5)."""
    config, _ = _validated(MLA + ["--moe-aux-loss-coeff", "0.01"])
    arch = config.model.architecture
    assert (arch["first_k_dense_replace"], arch["n_group"], arch["topk_group"], arch["routed_scaling_factor"]) == \
        (0, 1, 1, 1.0)
    assert (config.model.model_id, config.model.moe_router_score_function) == ("deepseek_v3", "softmax")
    config, _ = _validated(MLA + "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                                 "--moe-router-num-groups 2 --moe-router-group-topk 1".split())
    assert (config.model.moe_router_enable_expert_bias, config.model.moe_router_num_groups) == (True, 2)
    assert (config.model.architecture["n_group"], config.model.architecture["topk_group"]) == (2, 1)


def test_pai_megatron_aux_loss_is_pre_softmax_aux_loss():
    """MindSpeed-LLM's pai_megatron_aux_loss: megatron-core's aux_loss on pre-softmax top-k routing; its routing
    reads no groups, scaling or --seq-aux (reported as without effect)."""
    argv = MLA + ("--moe-router-load-balancing-type pai_megatron_aux_loss --moe-aux-loss-coeff 0.01 --seq-aux "
                  "--moe-router-num-groups 2 --moe-router-group-topk 1 --moe-router-topk-scaling-factor 1.0").split()
    config, translation = _validated(argv)
    m = config.model
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff, m.moe_router_pre_softmax) == \
        (["aux_loss"], [0.01], True)
    assert m.moe_router_num_groups is None and m.architecture["n_group"] == 1
    reasons = translation.report.no_effect_reasons
    assert "--seq-aux" in translation.report.no_effect and "pai_megatron_aux_loss" in reasons["--seq-aux"]
    assert "--moe-router-num-groups" in translation.report.no_effect


def test_max_batch_size_has_no_effect_and_mindspeed_none_seq_aux_is_its_own_loss():
    _, translation = _validated(MLA + ["--max-batch-size", "4"])
    assert "--max-batch-size" in translation.report.no_effect
    # MindSpeed's --seq-aux under balancing 'none': its own loss (tests/models/test_router_mindspeed.py)
    config, _ = _validated(MLA + "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01 --seq-aux".split())
    assert (config.model.moe_router_load_balancing_type, config.model.moe_aux_loss_coeff) == \
        (["mindspeed_seq_aux_loss"], [0.01])
