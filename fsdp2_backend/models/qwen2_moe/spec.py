"""The spec of model id `qwen2_moe`: transformers' model with stacked experts and this project's router
(models/moe/family_swap.py); every layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="qwen2_moe", hf_model_types=("qwen2_moe",), build=lazy("moe.family_swap:build"),
    ep=True, router="megatron", router_promoted=True,
    checkpoint_keys=lazy("moe.hooks:family_checkpoint_keys"),
    from_checkpoint=lazy("moe.hooks:family_from_checkpoint"),
    configure=lazy("moe.hooks:configure_moe_run"),
)
