"""MindSpeed-LLM's MiniMax-M2 lines (`--spec mindspeed_llm.tasks.models.spec.minimax_spec layer_spec`,
`--model-type-hf minimax_m2`) → `model.model_id minimax_m27` over the HF directory in `--load`.

MindSpeed builds that model with MiniMax's own router: sigmoid scores, experts selected on scores + the expert
bias (`--moe-router-enable-expert-bias`, the HF checkpoint's `e_score_correction_bias`), the k unbiased scores
renormalised. Its scripts therefore give no `--moe-router-score-function`; read as a plain Megatron GPT they
would mean megatron-core's softmax default, which MiniMax-M2 never used. The model id `minimax_m27`
(`fsdp2_backend/models/minimax_m27/modeling.py`) is that router; the expert-bias update moves the checkpoint's bias.

Its HF config names follow Mixtral's (`num_local_experts`, `intermediate_size` = the expert width). From flags
alone (no HF directory) the model is declined: its q/k norm over all heads and partial rotary width have no
Megatron flags.
"""
from __future__ import annotations

MODEL_ID = "minimax_m27"
_HF_TYPES = ("minimax_m2", "minimax-m2", "minimax_m27", "minimax")


def selects_minimax(ns, active) -> bool:
    """True when `--model-type-hf` or MindSpeed's `--spec` names MiniMax-M2."""
    if str(getattr(ns, "model_type_hf", None) or "").lower() in _HF_TYPES:
        return True
    spec = getattr(ns, "spec", None) or []
    return any("minimax_spec" in str(part) for part in (spec if isinstance(spec, (list, tuple)) else [spec]))


def apply(a) -> None:
    """The model id from the selecting flag; from scratch, a decline naming it."""
    dest = "model_type_hf" if "model_type_hf" in a.active and a.get("model_type_hf") else "spec"
    if a.from_scratch:
        a.decline(dest, "a MiniMax-M2 model (q/k norm over all heads, partial rotary) cannot be built from "
                        "Megatron flags — give --load with its HF directory")
        return
    a.field(dest, "model.model_id", MODEL_ID)
    other = "spec" if dest == "model_type_hf" else "model_type_hf"
    a.note(other, "mapped", f"model.model_id ({MODEL_ID})")
