"""The spec of model id `mamba3`: this project's Mamba-3 (an SSM, its own HF model type); FSDP only."""
from fsdp2_backend.models.spec import ModelSpec, lazy

_FSDP_ONLY = ("parallel.{which}: model_id mamba3 runs with FSDP only — tensor and context parallel are not built "
              "for its scan; use tp_size 1 and cp_size 1")

SPEC = ModelSpec(
    model_id="mamba3", hf_model_types=("mamba3",), build=lazy("mamba3.modeling:build_mamba3"),
    # the mixer is not split by heads (TP) and its scan does not pass states between cp ranks (CP)
    tp=False, cp_kinds=(), notes={"tp": _FSDP_ONLY, "cp": _FSDP_ONLY},
    attention_free=True,
    register_hf=lazy("mamba3.modeling:register_with_transformers"),
)
