"""The spec of model id `mixtral`: transformers' model with stacked experts and this project's router
(models/moe/family_swap.py); every layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="mixtral", hf_model_types=("mixtral",), build=lazy("moe.family_swap:build"),
    ep=True, router="megatron", router_promoted=True,
    # Mixtral's checkpoints keep per-expert w1 / w3 / w2, MiniMax-M2's layout
    checkpoint_keys=lazy("minimax_m27.modeling:checkpoint_keys"),
    from_checkpoint=lazy("minimax_m27.modeling:param_from_checkpoint"),
    configure=lazy("moe.hooks:configure_moe_run"),
)
