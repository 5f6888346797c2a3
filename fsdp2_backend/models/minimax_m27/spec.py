"""The spec of model id `minimax_m27` (HF model type minimax_m2): grouped experts, a sigmoid router with the
checkpoint's bias; no tensor parallel."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="minimax_m27", hf_model_types=("minimax_m2",), build=lazy("minimax_m27.modeling:build_minimax_m2"),
    # q/k RMSNorm runs over the whole projection (all heads): a head-sharded norm would need the variance summed
    # over the tp ranks, which is not built
    tp=False,
    notes={"tp": "parallel.tp_size: model_id minimax_m27 normalises q and k over all heads at once, which tensor "
                 "parallel would split — use tp_size 1 (FSDP, EP and CP still apply)"},
    ep=True, router="megatron", router_scores_sigmoid=True, native_checkpoint_layout=True,
    checkpoint_keys=lazy("minimax_m27.modeling:checkpoint_keys"),
    from_checkpoint=lazy("minimax_m27.modeling:param_from_checkpoint"),
    configure=lazy("minimax_m27.modeling:configure_minimax", drop_last=True),
)
