"""The spec of model id `qwen3`: transformers' Qwen3 (dense); every layout; MTP in this project's own layout."""
from fsdp2_backend.models.spec import ModelSpec, lazy

SPEC = ModelSpec(
    model_id="qwen3", hf_model_types=("qwen3",), build=lazy("qwen3.modeling:build_qwen3"),
    mtp_layout="mtp_layouts:MTPLayout",  # mtp.layers.{k}.* as in memory (this project's export)
)
