"""MindSpeed-LLM's router variants, which megatron-core 0.16.1 lacks: the `sqrtsoftplus` score function
(DeepSeek-V4) and `--seq-aux` under load-balancing type 'none' (the router's `mindspeed_seq_aux_loss`).

The reference is written here from MindSpeed's formulas in plain torch ops, independent of the router's code:
- routing (MindSpeed-LLM `core/transformer/moe/moe_utils.py`, `topk_softmax_with_capacity` and its hash variant):
  scores = sqrt(softplus(logits)) in fp32; top-k on `scores + expert_bias` (megatron-core's own
  `group_limited_topk` when groups are set); the unbiased scores of the k renormalised (k > 1); times the top-k
  scaling factor;
- megatron-core's load-balancing losses with sqrtsoftplus scores take them sum-normalised over all experts
  (Megatron-LM's `compute_routing_scores_for_aux_loss` after 0.16.1), through megatron-core's own
  `switch_load_balancing_loss_func`;
- MindSpeed's `apply_seq_aux_loss`: scores (softmax; or sigmoid / sqrtsoftplus plus the expert bias, normalised
  over the experts), per sequence P_i = mean over its tokens, f_i = E / (k·S) × (tokens of the sequence that
  selected expert i), loss = coeff × mean over sequences of Σ_i P_i f_i, logged as `load_balancing_loss`.
  Its code counts with `histc` over the boolean routing map, which counts zeros and ones rather than experts
  (`test_mindspeed_histc_counts_zeros_and_ones_not_experts`); the counts here are the documented ones
  (DeepSeek-V3's complementary sequence-wise loss): the experts each token selected.
Checked: probabilities, selected experts, the logged loss, the weighted loss and the gradient reaching the logits;
in a DeepSeek-V3 model (`family_swap`); the Megatron mapping of the two corpus lines; a scaled-down DeepSeek-V3
corpus line with sqrtsoftplus training on one rank, its log line showing `load_balancing_loss`; Ulysses cp 2
printing the one-rank losses (the counts of each sequence summed over the cp group).
"""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.models.moe.router import TopKRouter, finish_router_step
from tests.support.router_reference import E, our_router

LINES = json.loads((Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json").read_text())
DEEPSEEK3 = LINES["mindspeed-llm:examples/mcore/deepseek3/pretrain_deepseek3_671b_4k_A3_ptd.sh"]
DEEPSEEK4 = LINES["mindspeed-llm:examples/mcore/deepseek4_flash/pretrain_deepseek4_flash_4k_A3_ptd.sh"]


# -- the reference, from MindSpeed's formulas -----------------------------------------------------------------------
def _pointwise(logits, score):
    return torch.sigmoid(logits) if score == "sigmoid" else torch.sqrt(F.softplus(logits))


def reference_routing(logits, k, score, bias=None, groups=None, group_topk=None, scaling=None):
    """(dense probabilities (T, E), routing map (T, E) bool) as MindSpeed routes."""
    from megatron.core.transformer.moe.moe_utils import group_limited_topk

    tokens = logits.shape[0]

    def pick(values):
        if group_topk:
            return group_limited_topk(values, k, tokens, E, groups, group_topk)
        return torch.topk(values, k=k, dim=1)

    if score == "softmax":
        top, idx = pick(logits)
        probs = torch.softmax(top, dim=-1)
    else:
        scores = _pointwise(logits, score)
        idx = pick(scores + bias if bias is not None else scores)[1]
        probs = scores.gather(1, idx)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling:
        probs = probs * scaling
    return (torch.zeros(tokens, E).scatter(1, idx, probs),
            torch.zeros(tokens, E, dtype=torch.bool).scatter(1, idx, True))


def reference_seq_aux(logits, routing_map, score, bias, coeff, k, batch):
    """MindSpeed's sequence aux loss (`apply_seq_aux_loss`), counts per sequence of the selected experts."""
    if score == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = _pointwise(logits, score)
        if bias is not None:
            scores = scores + bias
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    seq = logits.shape[0] // batch
    p = scores.view(batch, seq, E).mean(dim=1)                                  # P_i per sequence
    f = routing_map.view(batch, seq, E).sum(dim=1).float() / (seq * k / E)    # f_i per sequence
    return (p * f).sum(dim=1).mean() * coeff


# -- routing and losses on the same logits ----------------------------------------------------------------------------
ROUTING_CASES = {
    "k4_bias_scaling": dict(moe_router_topk=4, moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=1.5),
    "k1": dict(moe_router_topk=1),
    "groups_bias": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                        moe_router_enable_expert_bias=True),
}


def _router(options, score="sqrtsoftplus", bias_seed=None):
    ours = our_router(moe_router_score_function=score, **options)
    bias = None
    if ours.settings.expert_bias:  # a bias that already moved: the selection differs from the plain top-k
        bias = torch.randn(E, generator=torch.Generator().manual_seed(bias_seed or 7)) * 0.3
        ours.expert_bias.copy_(bias)
    return ours, bias


def _route_both(ours, bias, options, score, batch=3, seq=10, seed=0):
    torch.manual_seed(seed)
    logits = torch.randn(batch * seq, E) * 2
    ref_logits, our_logits = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    weights, index = ours.route(our_logits, batch)
    probs = torch.zeros(batch * seq, E).scatter(1, index, weights)
    ref_probs, ref_map = reference_routing(ref_logits, options["moe_router_topk"], score, bias,
                                           options.get("moe_router_num_groups"), options.get("moe_router_group_topk"),
                                           options.get("moe_router_topk_scaling_factor"))
    return (our_logits, probs, index), (ref_logits, ref_probs, ref_map)


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_sqrtsoftplus_routing_equals_mindspeeds(case):
    options = dict(ROUTING_CASES[case], moe_router_load_balancing_type="none")
    ours, bias = _router(options)
    (our_logits, probs, index), (ref_logits, ref_probs, ref_map) = _route_both(ours, bias, options, "sqrtsoftplus")
    assert torch.equal(probs != 0, ref_map)  # the selected experts
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(1))
    (probs * upstream).sum().backward()
    (ref_probs * upstream).sum().backward()
    torch.testing.assert_close(our_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    if bias is not None:  # the bias changed the choice somewhere (else the case would not test it)
        assert not torch.equal(ref_map, reference_routing(ref_logits.detach(), options["moe_router_topk"],
                                                          "sqrtsoftplus", None, options.get("moe_router_num_groups"),
                                                          options.get("moe_router_group_topk"))[1])
        counts = torch.bincount(index.reshape(-1), minlength=E).float()
        torch.testing.assert_close(ours.local_tokens_per_expert, counts)  # the load the bias update reads


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_megatron_losses_with_sqrtsoftplus_scores(kind):
    """megatron-core's losses, scores = sqrtsoftplus normalised over all experts (unbiased plain top-k map)."""
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

    batch, seq, k, coeff = 3, 10, 4, 0.05
    options = dict(moe_router_topk=k, moe_router_enable_expert_bias=True, moe_router_load_balancing_type=kind,
                   moe_aux_loss_coeff=coeff)
    ours, bias = _router(options)
    (our_logits, probs, _), (ref_logits, ref_probs, _) = _route_both(ours, bias, options, "sqrtsoftplus", batch, seq)
    scores = torch.sqrt(F.softplus(ref_logits))
    scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    routing_map = torch.zeros(batch * seq, E).scatter(1, torch.topk(scores, k, dim=1)[1], 1.0)
    if kind == "aux_loss":
        loss = switch_load_balancing_loss_func(scores, routing_map.sum(0), batch * seq, k, E, coeff)
        name = "load_balancing_loss"
    else:  # megatron-core's [s, b] layout: each sequence's experts side by side
        per_seq = lambda t: t.view(batch, seq, E).transpose(0, 1).reshape(seq, -1)  # noqa: E731
        loss = switch_load_balancing_loss_func(per_seq(scores), per_seq(routing_map).sum(0), seq, k, E, coeff) / batch
        name = "seq_load_balancing_loss"
    torch.testing.assert_close(ours.logged[name], (loss / coeff).detach(), rtol=1e-6, atol=1e-8)
    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(1))
    ((probs * upstream).sum() + ours.pending_loss).backward()
    ((ref_probs * upstream).sum() + loss).backward()
    torch.testing.assert_close(our_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)


SEQ_AUX_CASES = {
    "softmax": ("softmax", dict(moe_router_topk=2)),
    "sigmoid_bias_groups_scaling": ("sigmoid", dict(moe_router_topk=4, moe_router_enable_expert_bias=True,
                                                    moe_router_num_groups=4, moe_router_group_topk=2,
                                                    moe_router_topk_scaling_factor=2.5)),
    "sqrtsoftplus_bias_scaling": ("sqrtsoftplus", dict(moe_router_topk=6, moe_router_enable_expert_bias=True,
                                                       moe_router_topk_scaling_factor=1.5)),
    "sqrtsoftplus_k1": ("sqrtsoftplus", dict(moe_router_topk=1)),
}


@pytest.mark.parametrize("case", sorted(SEQ_AUX_CASES))
def test_mindspeed_seq_aux_loss_equals_mindspeeds_formula(case):
    score, options = SEQ_AUX_CASES[case]
    coeff, batch, seq = 0.001, 3, 10
    options = dict(options, moe_router_load_balancing_type="mindspeed_seq_aux_loss", moe_aux_loss_coeff=coeff)
    ours, bias = _router(options, score)
    (our_logits, probs, _), (ref_logits, ref_probs, ref_map) = _route_both(ours, bias, options, score, batch, seq)
    assert torch.equal(probs != 0, ref_map)
    torch.testing.assert_close(probs, ref_probs, rtol=1e-6, atol=1e-7)
    loss = reference_seq_aux(ref_logits, ref_map, score, bias, coeff, options["moe_router_topk"], batch)
    assert set(ours.logged) == {"load_balancing_loss"}  # under MindSpeed's name
    torch.testing.assert_close(ours.logged["load_balancing_loss"], (loss / coeff).detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.pending_loss, loss, rtol=1e-6, atol=1e-10)
    upstream = torch.randn(probs.shape, generator=torch.Generator().manual_seed(1))
    ((probs * upstream).sum() + ours.pending_loss * 1e3).backward()  # the loss's own gradient, not drowned
    ((ref_probs * upstream).sum() + loss * 1e3).backward()
    torch.testing.assert_close(our_logits.grad, ref_logits.grad, rtol=1e-5, atol=1e-7)
    # a loss of its own: not megatron-core's seq_aux_loss on the same logits (other scores and counts)
    plain = our_router(moe_router_score_function=score, **dict(options, moe_router_load_balancing_type="seq_aux_loss"))
    plain.load_state_dict(ours.state_dict())
    plain.route(ref_logits.detach(), batch)
    if bias is not None:
        assert abs(plain.logged["seq_load_balancing_loss"] - ours.logged["load_balancing_loss"]) > 1e-4


def test_mindspeed_seq_aux_counts_the_routers_own_choice_under_fix_router():
    """MindSpeed applies the loss before fix_router replaces the routing map: the counts are the router's choice."""
    score, options = SEQ_AUX_CASES["sqrtsoftplus_bias_scaling"]
    options = dict(options, moe_router_load_balancing_type="mindspeed_seq_aux_loss", moe_aux_loss_coeff=0.01)
    ours, bias = _router(options, score)
    ours.fixed = True
    logits = torch.randn(2 * 12, E, generator=torch.Generator().manual_seed(4))
    _, index = ours.route(logits, 2)
    _, own_map = reference_routing(logits, 6, score, bias, scaling=1.5)
    assert not torch.equal(torch.zeros_like(own_map).scatter(1, index, True), own_map)  # the balanced assignment
    expected = reference_seq_aux(logits, own_map, score, bias, 0.01, 6, 2)
    torch.testing.assert_close(ours.logged["load_balancing_loss"], expected / 0.01, rtol=1e-6, atol=1e-8)


def test_mindspeed_histc_counts_zeros_and_ones_not_experts():
    """Why the counts differ from MindSpeed's code: `histc` over the boolean map (E bins on [0, E]) puts the
    S·(E − k) zeros in bin 0 and the S·k ones in bin 1 — not the tokens per expert the documented loss uses."""
    seq, k = 10, 3
    routing_map = torch.zeros(seq, E, dtype=torch.bool).scatter(1, torch.randn(seq, E).topk(k, dim=1)[1], True)
    literal = torch.histc(routing_map.view(1, -1)[0].to(torch.int32).float(), bins=E, min=0, max=E)
    assert literal[0] == seq * (E - k) and literal[1] == seq * k and literal[2:].sum() == 0
    assert not torch.equal(literal, routing_map.sum(0).float())


# -- in a model: DeepSeek-V3 (family_swap) with the DeepSeek-V4 router ------------------------------------------------
def test_deepseek_v3_model_aux_loss_is_mindspeeds_sum_over_layers():
    from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
    from tests.support.router_reference import B, S, RouterFields, family_ids, family_pair

    options = dict(moe_router_score_function="sqrtsoftplus", moe_router_enable_expert_bias=True,
                   moe_router_load_balancing_type=["mindspeed_seq_aux_loss"], moe_aux_loss_coeff=[0.01],
                   moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=1.5)
    _, model = family_pair("deepseek_v3")  # its e_score_correction_bias random: it selects, it is the expert bias
    configure_moe(model, moe_grouped_gemm=False, fix_router=False, model_args=RouterFields(options))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    seen = []
    for router in routers:
        router.register_forward_hook(lambda m, i, out: seen.append([t.detach() for t in out]))
    out = model(input_ids=family_ids(), use_cache=False)
    expected = 0.0
    for router, (logits, weights, index) in zip(routers, seen):
        bias = router.e_score_correction_bias.clone()
        ref_probs, ref_map = reference_routing(logits, 4, "sqrtsoftplus", bias, 4, 2, 1.5)
        torch.testing.assert_close(torch.zeros(B * S, E).scatter(1, index, weights), ref_probs, rtol=1e-5, atol=1e-6)
        expected = expected + reference_seq_aux(logits, ref_map, "sqrtsoftplus", bias, 0.01, 4, B)
    torch.testing.assert_close(out.aux_loss.detach(), expected, rtol=1e-5, atol=1e-9)
    out.aux_loss.backward()
    assert all(r.weight.grad.abs().sum() > 0 for r in routers)
    before = [r.e_score_correction_bias.clone() for r in routers]
    assert finish_router_step(model, num_microbatches=1).keys() == {"load_balancing_loss"}
    assert all(not torch.equal(r.e_score_correction_bias, b) for r, b in zip(routers, before))  # updated


# -- configuration: Megatron flags and native fields ------------------------------------------------------------------
def test_corpus_lines_map_to_the_mindspeed_router():
    from megatron_compat.translate import translate_megatron

    v3 = translate_megatron(DEEPSEEK3).fields["model"]
    assert (v3["moe_router_score_function"], v3["moe_router_load_balancing_type"], v3["moe_aux_loss_coeff"]) == \
        ("sigmoid", ["mindspeed_seq_aux_loss"], [0.0001])
    v4 = translate_megatron(DEEPSEEK4).fields["model"]
    assert (v4["moe_router_score_function"], v4["moe_router_load_balancing_type"], v4["moe_aux_loss_coeff"]) == \
        ("sqrtsoftplus", ["mindspeed_seq_aux_loss"], [0.001])
    assert v4["moe_router_enable_expert_bias"] and v4["moe_router_topk_scaling_factor"] == 1.5


def test_native_fields_and_their_rules():
    from fsdp2_backend.config import ModelArguments
    from fsdp2_backend.config.loading import build_config
    from fsdp2_backend.config.rules.model import router_errors
    from fsdp2_backend.usage_errors import UsageError

    config = build_config([("test", {"model": {"moe_router_score_function": "sqrtsoftplus",
                                               "moe_router_load_balancing_type": "mindspeed_seq_aux_loss",
                                               "moe_aux_loss_coeff": 0.01, "moe_router_enable_expert_bias": True}})])
    assert not router_errors(config.model)  # the expert bias applies to sqrtsoftplus scores
    with pytest.raises(UsageError):
        build_config([("test", {"model": {"moe_router_score_function": "sqrtplus"}})])
    both = router_errors(ModelArguments(moe_router_load_balancing_type=["aux_loss", "mindspeed_seq_aux_loss"],
                                        moe_aux_loss_coeff=[0.1, 0.1]))
    assert any(m.startswith("model.moe_router_load_balancing_type: mindspeed_seq_aux_loss") for m in both)
    assert router_errors(ModelArguments(moe_router_score_function="softmax", moe_router_enable_expert_bias=True))


# -- end to end: the DeepSeek-V3 corpus line, scaled down, with the DeepSeek-V4 router -------------------------------
def test_scaled_down_corpus_line_logs_mindspeeds_loss(tmp_path):
    import re

    from tests.support.launchers import run_pretrain
    from tests.support.megatron_lines import edit_flags

    drop = ("--save", "--load", "--tokenizer-name-or-path", "--tokenizer-type", "--data-path", "--noop-layers",
            "--schedules-method", "--padded-vocab-size")
    argv = edit_flags(DEEPSEEK3, drop=drop, num_layers=2, hidden_size=32, ffn_hidden_size=64, moe_ffn_hidden_size=16,
                 moe_shared_expert_intermediate_size=16, num_attention_heads=4, seq_length=32,
                 max_position_embeddings=64, num_experts=8, moe_router_num_groups=4, moe_router_group_topk=2,
                 moe_router_topk=4, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                 qk_pos_emb_head_dim=8, v_head_dim=8, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                 expert_model_parallel_size=1, global_batch_size=2, train_iters=2, save_interval=2,
                 lr_warmup_iters=0, vocab_size=128, recompute_num_layers=1,
                 rope_scaling_original_max_position_embeddings=16, moe_router_score_function="sqrtsoftplus",
                 moe_aux_loss_coeff=0.01)
    _, log = run_pretrain(argv + ["--mock-data", "--tokenizer-type", "NullTokenizer"], tmp_path / "ckpt")
    found = re.findall(r" iteration\s+(\d+)/.*? lm loss: \S+ \| load_balancing_loss: (\S+) \|", log)
    assert [int(it) for it, _ in found] == [1, 2], log[-3000:]
    # Σ_i P_i f_i with Σ_i P_i = 1 and f_i ≤ E / k (a token selects an expert once): in (0, 8 / 4], 1 if balanced
    assert all(0 < float(value) <= 2 for _, value in found), found
    config = json.loads((tmp_path / "ckpt" / "iter_0000002" / "run_config.json").read_text())["model"]
    assert (config["model_id"], config["moe_router_score_function"], config["moe_router_load_balancing_type"]) == \
        ("deepseek_v3", "sqrtsoftplus", ["mindspeed_seq_aux_loss"])


def test_context_parallel_2_prints_the_one_rank_mindspeed_loss(tmp_path):
    """Ulysses cp 2: each rank's share of every sequence's loss (its own scores, the counts summed over the cp
    group) adds up to the one-rank loss; 4 steps agree (the gradients too, or later steps would drift)."""
    from tests.support.launchers import run_pretrain
    from tests.support.router_runs import logged_losses
    from tests.support.megatron_lines import ROUTER_RUN_FLAGS

    flags = list(ROUTER_RUN_FLAGS)
    for flag, value in (("--train-iters", "4"), ("--save-interval", "100"), ("--moe-router-score-function",
                                                                             "sqrtsoftplus")):
        flags[flags.index(flag) + 1] = value
    flags += ["--moe-router-load-balancing-type", "none", "--seq-aux"]
    _, log1 = run_pretrain(flags, tmp_path / "one")
    _, log2 = run_pretrain(flags, tmp_path / "cp2", "--context-parallel-size", "2",
                           "--context-parallel-algo", "ulysses_cp_algo", ranks=2)
    one, cp2 = logged_losses(log1), logged_losses(log2)
    assert sorted(one) == [1, 2, 3, 4] and sorted(cp2) == [1, 2, 3, 4], (log1[-1500:], log2[-1500:])
    for it in one:
        assert set(one[it]) == {"lm loss", "z_loss", "load_balancing_loss"}, one[it]
        for name, value in one[it].items():
            assert cp2[it][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (it, name, one[it], cp2[it])
