"""The router's Megatron options vs megatron-core 0.16.1's own `TopKRouter.routing` on the same logits.

megatron-core runs on CPU given a 1-rank gloo group and `torch.cuda.current_device` returning "cpu" (its
gating GEMM needs Transformer Engine, so both sides start from the same logits). Compared: the dense
probabilities and routing map, every tracked loss (`load_balancing_loss`, `seq_load_balancing_loss`,
`global_load_balancing_loss`, `z_loss`), the gradient reaching the logits (megatron-core attaches its losses
with `MoEAuxLossAutoScaler`, we add them to the loss), the token counts and the expert-bias update of
`finalize_model_grads`.
"""
import warnings

import pytest
import torch

from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter, finish_router_step
from tests.support.router_reference import E, H, ROUTER_CASES, megatron_router, our_router
from tests.support.router_reference import megatron  # noqa: F401  (a fixture)

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


def _dense(weights, index):
    return torch.zeros(index.shape[0], E, dtype=weights.dtype).scatter(1, index, weights)


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
def test_router_matches_megatron_core(megatron, case):
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    options = ROUTER_CASES[case]
    torch.manual_seed(sorted(ROUTER_CASES).index(case))
    batch, seq = 3, 10
    logits = torch.randn(batch, seq, E) * 2
    reference, ours = megatron_router(megatron, **options), our_router(**options)
    if ours.settings.expert_bias:  # a bias that already moved: selection differs from the plain top-k
        bias = torch.randn(E) * 0.3
        reference.expert_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    clear_aux_losses_tracker()
    ref_logits = logits.transpose(0, 1).contiguous().requires_grad_()  # megatron-core: [seq, batch, experts]
    our_logits = logits.reshape(-1, E).clone().requires_grad_()        # ours: sequence after sequence
    ref_probs, ref_map = reference.routing(ref_logits)
    weights, index = ours.route(our_logits, batch)
    to_ours = lambda t: t.view(seq, batch, E).transpose(0, 1).reshape(-1, E)  # noqa: E731

    probs = _dense(weights, index)
    torch.testing.assert_close(probs, to_ours(ref_probs), rtol=1e-6, atol=1e-7)
    assert torch.equal(probs != 0, to_ours(ref_map))
    tracked = {name: v["values"][0] for name, v in get_moe_layer_wise_logging_tracker().items()
               if v["values"].abs().sum() > 0}
    assert set(tracked) == set(ours.logged)
    for name, value in tracked.items():
        torch.testing.assert_close(ours.logged[name], value, rtol=1e-6, atol=1e-8, msg=name)

    upstream = torch.randn(batch * seq, E)
    (to_ours(ref_probs) * upstream).sum().backward()
    loss = (probs * upstream).sum()
    loss = loss + ours.pending_loss if ours.pending_loss is not None else loss
    loss.backward()
    torch.testing.assert_close(our_logits.grad, to_ours(ref_logits.grad), rtol=1e-5, atol=1e-7)

    if ours.settings.expert_bias:
        from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

        torch.testing.assert_close(ours.local_tokens_per_expert, reference.local_tokens_per_expert)
        reference.config.moe_router_bias_update_rate = options["moe_router_bias_update_rate"] \
            if "moe_router_bias_update_rate" in options else 1e-3
        _update_router_expert_bias([reference], reference.config)
        finish_router_step(ours, num_microbatches=1)
        torch.testing.assert_close(ours.expert_bias, reference.expert_bias, rtol=0, atol=0)
        assert ours.local_tokens_per_expert.sum() == 0
        assert "expert_bias" in ours.state_dict()  # saved in checkpoints, as megatron-core's buffer


def test_global_aux_loss_accumulates_over_microbatches(megatron):
    """Two micro-batches: the second one's loss uses the average token counts of both, as megatron-core's."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    options = ROUTER_CASES["global_aux"]
    reference, ours = megatron_router(megatron, **options), our_router(**options)
    torch.manual_seed(5)
    for _ in range(2):
        clear_aux_losses_tracker()
        logits = torch.randn(1, 12, E, requires_grad=True)
        reference.routing(logits.transpose(0, 1))
        ours.logged = {}
        ours.route(logits.reshape(-1, E), 1)
        expected = get_moe_layer_wise_logging_tracker()["global_load_balancing_loss"]["values"][0]
        torch.testing.assert_close(ours.logged["global_load_balancing_loss"], expected, rtol=1e-6, atol=1e-8)
    finish_router_step(ours, num_microbatches=2)
    assert ours.ga_steps.item() == 0  # reset for the next global batch, as reset_model_temporary_tensors does


def test_router_dtype_and_evaluation():
    """`moe_router_dtype` fp64 computes the gating GEMM in fp64; evaluation adds no loss and counts no load."""
    settings = RouterSettings(num_experts=E, top_k=2, dtype="fp64", expert_bias=True, megatron_losses=True,
                              load_balancing=(("aux_loss", 0.1),), score_function="sigmoid")
    router = TopKRouter(settings, H).eval()
    torch.nn.init.normal_(router.weight)
    x = torch.randn(2, 5, H)
    logits, _, _ = router(x)
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, x.reshape(-1, H).double() @ router.weight.double().T)
    assert router.pending_loss is None and router.local_tokens_per_expert.sum() == 0
    router.train()(x)
    assert router.pending_loss is not None and router.local_tokens_per_expert.sum() == 10 * 2


def test_router_fields_checked_as_megatron_core_checks_them():
    from fsdp2_backend.config import ModelArguments
    from fsdp2_backend.config.rules.model import router_errors as _router_errors

    bad = ModelArguments(moe_router_load_balancing_type=["aux_loss", "bogus"], moe_aux_loss_coeff=[0.1],
                         moe_router_num_groups=4, moe_router_enable_expert_bias=True)
    found = _router_errors(bad)
    assert any(m.startswith("model.moe_router_load_balancing_type: 'bogus'") for m in found)
    assert any(m.startswith("model.moe_aux_loss_coeff: 1 coefficients for 2") for m in found)
    assert any(m.startswith("model.moe_router_num_groups / model.moe_router_group_topk") for m in found)
    assert any(m.startswith("model.moe_router_enable_expert_bias: the expert bias applies to sigmoid") for m in found)
    assert _router_errors(ModelArguments(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.1))
    assert not _router_errors(ModelArguments(moe_router_load_balancing_type="sinkhorn"))
