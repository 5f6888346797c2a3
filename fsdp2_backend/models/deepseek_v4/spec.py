"""The spec of model id `deepseek_v4` (MindSpeed-LLM master): grouped experts with its own hash and sqrt-softplus
routers (Megatron's router options declined), DSA context parallel over every layer kind
(parallel/context_parallel/dsa_deepseek_v4.py: no head split, no packed documents), MTP in its own layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="deepseek_v4", hf_model_types=("deepseek_v4",), build=lazy("deepseek_v4.modeling:build_deepseek_v4"),
    cp_layer_types=frozenset({"full_attention", "sliding_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention"}),  # windows (+sinks); DSA
    cp_splits_heads=False, cp_packed_documents=False,
    cp_hook="dsa_deepseek_v4:enable_deepseek_v4_context_parallel",
    ep=True, router="own", dsa=True, mindspeed_mhc=True, mindspeed_master_only=True,
    mtp_layout="deepseek_v4.mtp:DeepseekV4Layout",
    notes={"kvallgather": "parallel.cp_type: kvallgather for model_id deepseek_v4 — each rank's queries over the "
                          "whole sequence's all-gathered K=V and compressor inputs (parallel/context_parallel/"
                          "dsa_deepseek_v4.py)",
           "router": "model.moe_router_*: model_id deepseek_v4 routes with transformers' own routers (DeepSeek-V4's "
                     "hash and sqrt-softplus routers, LongCat's zero-expert router); Megatron's router options are "
                     "not applied to them — drop the options"},
    checkpoint_keys=lazy("deepseek_v4.modeling:checkpoint_keys"),
    from_checkpoint=lazy("deepseek_v4.modeling:param_from_checkpoint"),
    configure=lazy("deepseek_v4.modeling:configure_deepseek_v4", drop_last=True),
)
