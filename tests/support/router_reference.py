"""megatron-core 0.16.1's TopKRouter as the reference for ours: a 1-rank gloo group for it (the `megatron` fixture),
both routers built from the same Megatron options, the option sets the router tests run (`ROUTER_CASES`), the
config fields validation hands a model (`RouterFields`), and the router families' model next to transformers'
(`family_pair`)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp2_backend.models.moe.family_swap import GROUPED_CLASSES
from fsdp2_backend.models.moe.router import RouterSettings, TopKRouter
from tests.support.launchers import init_one_rank_group

E, H = 16, 8


@pytest.fixture(scope="module")
def megatron():
    """megatron-core's modules on a 1-rank gloo group (torn down after the module's tests)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        init_one_rank_group()
        from megatron.core import parallel_state
        from megatron.core.process_groups_config import ProcessGroupCollection

        parallel_state.initialize_model_parallel()
        world = dist.group.WORLD
        pg = ProcessGroupCollection(tp=world, cp=world, tp_cp=world, tp_dp_cp=world, dp=world, pp=world, ep=world)
        try:
            yield pg
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def megatron_router(pg, **options):
    """megatron-core's TopKRouter for `options` (TransformerConfig fields) on the fixture's groups."""
    from megatron.core.transformer.moe.router import TopKRouter as McoreRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                            use_cpu_initialization=True, **options)
    router = McoreRouter(cfg, pg_collection=pg)
    router.set_layer_number(1)
    return router


def our_router(**options) -> TopKRouter:
    """Our TopKRouter for the same Megatron `options`."""
    class Fields:  # the config's model.moe_* fields, as validation hands them to the model
        moe_router_score_function = options.get("moe_router_score_function")
        moe_router_pre_softmax = options.get("moe_router_pre_softmax")
        moe_router_num_groups = options.get("moe_router_num_groups")
        moe_router_group_topk = options.get("moe_router_group_topk")
        moe_router_topk_scaling_factor = options.get("moe_router_topk_scaling_factor")
        moe_router_dtype = None
        moe_z_loss_coeff = options.get("moe_z_loss_coeff")
        moe_router_enable_expert_bias = options.get("moe_router_enable_expert_bias", False)
        moe_router_bias_update_rate = options.get("moe_router_bias_update_rate", 1e-3)
        moe_router_load_balancing_type = options.get("moe_router_load_balancing_type", "aux_loss")
        moe_aux_loss_coeff = options.get("moe_aux_loss_coeff", 0.0)

    settings = RouterSettings(num_experts=E, top_k=options["moe_router_topk"]).with_model_fields(Fields)
    return TopKRouter(settings, H).train()


ROUTER_CASES = {
    "softmax_aux": dict(moe_router_topk=2, moe_aux_loss_coeff=0.01),
    "pre_softmax_seq_aux_z": dict(moe_router_topk=2, moe_router_pre_softmax=True, moe_aux_loss_coeff=0.1,
                                  moe_router_load_balancing_type="seq_aux_loss", moe_z_loss_coeff=1e-3),
    "sigmoid_bias_scaling": dict(moe_router_topk=4, moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
                                 moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=0.02),
    "groups_softmax": dict(moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                           moe_aux_loss_coeff=0.01),
    "groups_sigmoid_bias": dict(moe_router_topk=4, moe_router_score_function="sigmoid", moe_router_num_groups=4,
                                moe_router_group_topk=2, moe_router_enable_expert_bias=True,
                                moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.001),
    "global_aux": dict(moe_router_topk=2, moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.05),
    "two_losses": dict(moe_router_topk=3, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                       moe_aux_loss_coeff=[0.01, 0.1], moe_z_loss_coeff=0.01),
    "sinkhorn_k1": dict(moe_router_topk=1, moe_router_load_balancing_type="sinkhorn"),
    "sinkhorn_k2": dict(moe_router_topk=2, moe_router_load_balancing_type="sinkhorn"),
    "none": dict(moe_router_topk=2, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.5),
}


B, S = 2, 8


def family_pair(family: str):
    """(transformers' model, ours) with the same weights; DeepSeek's correction bias random (it selects)."""
    from transformers import AutoModelForCausalLM

    from tests.support.tiny_models import tiny_family_config  # here: tiny_models imports E from this module

    config = tiny_family_config(family)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    state = {k: (torch.randn_like(v) * 0.05 if k.endswith("e_score_correction_bias") else v)
             for k, v in reference.state_dict().items()}
    reference.load_state_dict(state)
    ours = GROUPED_CLASSES[family](config)
    ours.load_state_dict(state, strict=True)
    return reference.train(), ours.train()


def family_ids():
    """A (B, S) batch of token ids for the family models."""
    return torch.randint(0, 96, (B, S), generator=torch.Generator().manual_seed(3))


class RouterFields:
    """The config's model.moe_* fields, as validation hands them to the model (test_router_megatron's cases)."""

    def __init__(self, options):
        self.moe_router_score_function = options.get("moe_router_score_function")
        self.moe_router_pre_softmax = options.get("moe_router_pre_softmax")
        self.moe_router_num_groups = options.get("moe_router_num_groups")
        self.moe_router_group_topk = options.get("moe_router_group_topk")
        self.moe_router_topk_scaling_factor = options.get("moe_router_topk_scaling_factor")
        self.moe_router_dtype = None
        self.moe_z_loss_coeff = options.get("moe_z_loss_coeff")
        self.moe_router_enable_expert_bias = options.get("moe_router_enable_expert_bias", False)
        self.moe_router_bias_update_rate = options.get("moe_router_bias_update_rate", 1e-3)
        self.moe_router_load_balancing_type = options.get("moe_router_load_balancing_type", "aux_loss")
        self.moe_aux_loss_coeff = options.get("moe_aux_loss_coeff", 0.0)
