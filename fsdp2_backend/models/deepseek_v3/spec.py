"""The spec of model id `deepseek_v3`: transformers' DeepSeek-V3 with stacked experts and this project's router
(models/moe/family_swap.py); MTP layers appended to the main layers, as DeepSeek-V3 releases them."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="deepseek_v3", hf_model_types=("deepseek_v3",), name="DeepSeek-V3",
    build=lazy("moe.family_swap:build"),
    ep=True, router="megatron", router_promoted=True, group_score_top2=True, renormalises_topk=True,
    mtp_layout="mtp_layouts:TrailingLayersLayout",
    checkpoint_keys=lazy("moe.hooks:family_checkpoint_keys"),
    from_checkpoint=lazy("moe.hooks:family_from_checkpoint"),
    configure=lazy("moe.hooks:configure_moe_run"),
)
