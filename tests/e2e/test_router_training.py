"""Megatron's router options in a model and in training.

In the model (qwen3_moe): `aux_loss` is the sum over layers of megatron-core's losses on each layer's router
logits, it reaches the gradients (also under activation recomputation), and the expert bias is initialised to
0 on the meta device. In training (the entry point, Megatron flags): one rank and expert parallel 2 (dp 2)
print the same lm loss, `load_balancing_loss` and `z_loss` for 8 steps, move the expert bias identically and
save it in the checkpoint, and the EP 2 checkpoint continues at one rank with no architecture flag.
"""
import shutil

import pytest
import torch

from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter, finish_router_step
from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe, configure_moe
from tests.support.launchers import run_pretrain
from tests.support.tiny_models import tiny_moe_config
from tests.support.megatron_lines import ROUTER_RUN_FLAGS


class _Fields:
    """The config's model.moe_* fields for these tests."""
    moe_router_score_function = "sigmoid"
    moe_router_pre_softmax = None
    moe_router_num_groups = None
    moe_router_group_topk = None
    moe_router_topk_scaling_factor = None
    moe_router_dtype = None
    moe_z_loss_coeff = 1e-2
    moe_router_enable_expert_bias = True
    moe_router_bias_update_rate = 0.05
    moe_router_load_balancing_type = ["aux_loss", "seq_aux_loss"]
    moe_aux_loss_coeff = [0.02, 0.03]


def _model():
    torch.manual_seed(0)
    model = build_qwen3_moe(tiny_moe_config(output_router_logits=False))
    configure_moe(model, moe_grouped_gemm=False, fix_router=False, model_args=_Fields)
    return model.train()


def _ids():
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def test_model_aux_loss_is_the_sum_of_megatron_core_losses_over_layers():
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func, z_loss_func)

    model = _model()
    captured = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, i, out: captured.append(out[0].detach()))
    out = model(input_ids=_ids(), use_cache=False)
    assert model.router_aux_loss_coef == 1.0 and not model.config.output_router_logits
    expected = 0.0
    for logits in captured:  # (batch * seq, experts), sequence after sequence
        expected += z_loss_func(logits, 1e-2)
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, 2, "sigmoid")
        expected += switch_load_balancing_loss_func(scores, routing_map.sum(0), 32, 2, 4, 0.02)
        per_seq = lambda t: t.view(2, 16, 4).transpose(0, 1).reshape(16, 8)  # noqa: E731  megatron's [s, b]
        expected += switch_load_balancing_loss_func(per_seq(scores), per_seq(routing_map).sum(0), 16, 2, 4,
                                                    0.03) / 2
    torch.testing.assert_close(out.aux_loss.detach(), expected, rtol=1e-6, atol=1e-8)
    out.aux_loss.backward()
    assert all(layer.mlp.gate.weight.grad.abs().sum() > 0 for layer in model.model.layers)


def test_gradients_equal_under_recompute():
    from fsdp2_backend.parallel.recompute import apply_recompute

    grads = []
    for recompute in (False, True):
        model = _model()
        if recompute:
            apply_recompute(model, ["model.layers.{*}"])
        out = model(input_ids=_ids(), use_cache=False)
        (out.logits.float().pow(2).mean() + out.aux_loss).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        counts = [layer.mlp.gate.local_tokens_per_expert.clone() for layer in model.model.layers]
        finish_router_step(model, num_microbatches=1)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(c.sum() > 0 for c in counts)


def test_expert_bias_buffers_start_at_zero_on_meta():
    with torch.device("meta"):
        router = TopKRouter(RouterSettings(num_experts=4, top_k=2, expert_bias=True), 8)
    router.to_empty(device="cpu")
    router.expert_bias.fill_(float("nan"))
    model = build_qwen3_moe(tiny_moe_config())
    model._init_weights(router)  # the seeded initialisation's hook for meta-built models
    assert torch.equal(router.expert_bias, torch.zeros(4))


def _moe_losses(log):
    import re

    found = re.findall(r" iteration\s+(\d+)/.*? lm loss: (\S+) \| z_loss: (\S+) \| load_balancing_loss: (\S+) \|",
                       log)
    return {int(it): tuple(float(v) for v in values) for it, *values in found}


def _expert_biases(checkpoint):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(checkpoint) + ".pt")
    state = torch.load(str(checkpoint) + ".pt", weights_only=False)["model"]
    return {k: v for k, v in state.items() if k.endswith("expert_bias")}


def test_expert_parallel_2_equals_one_rank_with_megatron_router(tmp_path):
    _, log1 = run_pretrain(ROUTER_RUN_FLAGS, tmp_path / "one")
    _, log2 = run_pretrain(ROUTER_RUN_FLAGS, tmp_path / "ep2", "--expert-model-parallel-size", "2", ranks=2)
    one, ep2 = _moe_losses(log1), _moe_losses(log2)
    assert sorted(one) == list(range(1, 9)) and sorted(ep2) == list(range(1, 9))
    for it in one:
        assert ep2[it] == pytest.approx(one[it], rel=1e-4), (it, one[it], ep2[it])
    biases = _expert_biases(tmp_path / "one" / "iter_0000004")
    assert len(biases) == 2 and any(b.abs().sum() > 0 for b in biases.values())  # moved, and saved
    for name, bias in _expert_biases(tmp_path / "ep2" / "iter_0000004").items():
        torch.testing.assert_close(bias, biases[name], rtol=0, atol=1e-7)
    # the EP 2 checkpoint continues at one rank, with no architecture flag: steps 5..8 as the one-rank run
    from tests.support.megatron_lines import without_architecture

    shutil.copytree(tmp_path / "ep2" / "iter_0000004", tmp_path / "ckpt" / "iter_0000004")
    _, log = run_pretrain(without_architecture(ROUTER_RUN_FLAGS), tmp_path / "continued", "--load", str(tmp_path / "ckpt"))
    continued = _moe_losses(log)
    assert sorted(continued) == [5, 6, 7, 8]
    for it in continued:
        assert continued[it] == pytest.approx(one[it], rel=1e-4), (it, one[it], continued[it])
