"""The spec of model id `step35` (HF model type step3p5, which transformers builds no causal LM for): grouped
experts, a sigmoid router selecting with the checkpoint's bias; no tensor parallel; context parallel over its
sliding-window layers; MTP in Step-3.5's layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="step35", hf_model_types=("step3p5",), build=lazy("step35.modeling:build_step35"),
    needs_model_id=True,
    # the head-wise output gate (g_proj) and the per-layer-type head counts are not in the tp plan
    tp=False,
    cp_layer_types=frozenset({"full_attention", "sliding_attention"}),
    ep=True, router="megatron", router_scores_sigmoid=True, expert_bias=False,
    mtp_layout="step35.mtp:Step35Layout",
    notes={"tp": "parallel.tp_size: model_id step35 is not built for tensor parallel (its head-wise attention gate "
                 "and per-layer-type head counts are not sharded) — use tp_size 1 (FSDP, EP and CP apply)",
           "expert_bias": "model.moe_router_enable_expert_bias (--moe-router-enable-expert-bias): model_id step35 "
                          "selects experts with the checkpoint's moe.router_bias, which this project does not update "
                          "— drop the flag"},
    checkpoint_keys=lazy("step35.modeling:checkpoint_keys"),
    from_checkpoint=lazy("step35.modeling:param_from_checkpoint"),
    configure=lazy("step35.modeling:configure_step35", drop_last=True),
)
