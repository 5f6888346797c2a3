"""The spec of model id `qwen3_next`: Qwen3-Next (Gated DeltaNet + attention, stacked experts, this project's router);
context parallel over its linear-attention layers too; MTP in the released one-depth layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="qwen3_next", hf_model_types=("qwen3_next",), build=lazy("qwen3_next.modeling:build_qwen3_next"),
    ep=True, router="megatron", native_checkpoint_layout=True,
    cp_layer_types=frozenset({"full_attention", "linear_attention"}),  # parallel/context_parallel/linear_attention.py
    mtp_layout="qwen3_next.mtp:Qwen3NextLayout", mtp_depths=1,
    notes={"mtp": "model.model_id qwen3_next and mtp_num_layers {mtp} (Qwen3-Next's MTP layout holds one depth: "
                  "give mtp_num_layers 1)"},
    checkpoint_keys=lazy("moe.hooks:expert_checkpoint_keys"),  # the same expert keys as qwen3_moe
    from_checkpoint=lazy("moe.hooks:expert_from_checkpoint"),
    configure=lazy("moe.hooks:configure_qwen3_next_run"),
)
