"""The spec of model id `glm52` (HF model type glm_moe_dsa): transformers' GLM-MoE-DSA with stacked experts and this
project's router (models/moe/family_swap.py), DSA context parallel (parallel/context_parallel/dsa_glm.py: no head
split, no packed documents), MindSpeed's DSA indexer loss."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="glm52", hf_model_types=("glm_moe_dsa",), name="GLM-MoE-DSA", build=lazy("moe.family_swap:build"),
    cp_layer_types=frozenset({"full_attention", "indexed_attention"}),
    cp_splits_heads=False, cp_packed_documents=False, cp_hook="dsa_glm:enable_glm_context_parallel",
    ep=True, router="megatron", group_score_top2=True, dsa=True,
    notes={"kvallgather": "parallel.cp_type: kvallgather for model_id glm52 — each rank's queries over the whole "
                          "sequence's all-gathered MLA key latents and indexer keys (parallel/context_parallel/"
                          "dsa_glm.py)"},
    checkpoint_keys=lazy("moe.hooks:family_checkpoint_keys"),
    from_checkpoint=lazy("moe.hooks:family_from_checkpoint"),
    configure=lazy("moe.hooks:configure_indexed_moe_run"),
)
