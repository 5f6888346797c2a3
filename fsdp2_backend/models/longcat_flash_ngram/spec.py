"""The spec of model id `longcat_flash_ngram` (MindSpeed-LLM v26.1.0 calls it longcat_flash): LongCat-Flash with
n-gram embeddings and grouped experts, its own zero-expert router (Megatron's router options declined); its config
class registered with transformers; MindSpeed's merged experts read as stored."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="longcat_flash_ngram", hf_model_types=("longcat_flash_ngram",),
    build=lazy("longcat_flash_ngram.modeling:build_longcat_ngram"),
    aliases={"longcat_flash": "MindSpeed-LLM v26.1.0's name"},
    ep=True, router="own",
    notes={"router": "model.moe_router_*: model_id longcat_flash_ngram routes with transformers' own routers "
                     "(DeepSeek-V4's hash and sqrt-softplus routers, LongCat's zero-expert router); Megatron's router "
                     "options are not applied to them — drop the options"},
    checkpoint_keys=lazy("longcat_flash_ngram.modeling:checkpoint_keys"),
    from_checkpoint=lazy("longcat_flash_ngram.modeling:param_from_checkpoint"),
    configure=lazy("longcat_flash_ngram.modeling:configure_longcat", drop_last=True),
    register_hf=lazy("longcat_flash_ngram.modeling:register_with_transformers"),
    stored_layout=lazy("longcat_flash_ngram.modeling:stored_layout"),  # merged experts
)
