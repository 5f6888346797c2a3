"""Validation of MindSpeed's MLA latent scales (`model.mla_scale_q_lora` / `mla_scale_kv_lora`; models/mla_lora_scale.py),
torch-free: the model must have multi-latent attention, and the query factor a query latent (MindSpeed divides
hidden_size by q_lora_rank). Checked from the model's config (HF directory, checkpoint or architecture flags)
before any process group; a model whose config is not known here is checked again when it is built."""
from __future__ import annotations

from typing import Any, List


def mla_scale_errors(config: Any, facts: Any) -> List[str]:
    m = config.model
    if not (m.mla_scale_q_lora or m.mla_scale_kv_lora):
        return []
    values = dict(getattr(facts, "config_json", None) or {})
    values.update(m.architecture or {})
    if not values:
        return []
    field = "model.mla_scale_q_lora" if m.mla_scale_q_lora else "model.mla_scale_kv_lora"
    if not values.get("kv_lora_rank"):
        return [f"{field}: the model ({values.get('model_type', 'unknown type')}) has no multi-latent attention "
                f"(no kv_lora_rank) — drop the flag (--enable-mla-scale-*), or train an MLA model"]
    if m.mla_scale_q_lora and not values.get("q_lora_rank"):
        return ["model.mla_scale_q_lora: the model's multi-latent attention has no query latent (q_lora_rank "
                "unset), so there is nothing to scale — drop --enable-mla-scale-q-lora"]
    return []
