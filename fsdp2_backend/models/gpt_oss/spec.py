"""The spec of model id `gpt_oss`: sink attention, grouped experts, this project's router; no tensor parallel
(declined for transformers' gpt_oss model too); context parallel over its sliding-window layers."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="gpt_oss", hf_model_types=("gpt_oss",), build=lazy("gpt_oss.modeling:build_gpt_oss"),
    # the per-head sinks (and the stacked experts' biases) are not in the tp plan: a head-sharded attention would
    # pair every rank's heads with all the sinks
    tp=False, declines_transformers_model=True,
    notes={"tp": "parallel.tp_size: gpt_oss's attention sinks (one per head) are not sharded by the tensor-parallel "
                 "plan — use tp_size 1 (FSDP, EP and Ulysses/ring CP apply)"},
    cp_layer_types=frozenset({"full_attention", "sliding_attention"}),  # windows + sinks: context_parallel/attention.py
    ep=True, router="megatron",
    checkpoint_keys=lazy("gpt_oss.modeling:checkpoint_keys"),
    from_checkpoint=lazy("gpt_oss.modeling:param_from_checkpoint", drop_last=True),
    configure=lazy("moe.hooks:configure_moe_run"),
)
