"""The spec of model id `qwen3_moe`: Qwen3-MoE with stacked experts and this project's router; every layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="qwen3_moe", hf_model_types=("qwen3_moe",), build=lazy("qwen3_moe.modeling:build_qwen3_moe"),
    ep=True, router="megatron", router_promoted=True,
    native_checkpoint_layout=True,  # transformers' class stacks the experts as ours do
    checkpoint_keys=lazy("moe.hooks:expert_checkpoint_keys"),
    from_checkpoint=lazy("moe.hooks:expert_from_checkpoint"),
    configure=lazy("moe.hooks:configure_moe_run"),
)
