"""This project's Mamba-3 causal LM (`model_id: mamba3`): `Mamba3Config`, `Mamba3ForCausalLM`, and their
registration with transformers' Auto classes (`register_with_transformers`), so `AutoConfig` /
`AutoModelForCausalLM` load a saved `model_type: mamba3` directory once this package is imported.
"""
from __future__ import annotations

from fsdp2_backend.models.mamba3.configuration import Mamba3Config
from fsdp2_backend.models.mamba3.modeling import Mamba3ForCausalLM, Mamba3Model


def register_with_transformers() -> None:
    """Registers model_type "mamba3" with AutoConfig and AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "mamba3" not in CONFIG_MAPPING:
        AutoConfig.register("mamba3", Mamba3Config)
        AutoModelForCausalLM.register(Mamba3Config, Mamba3ForCausalLM)


def build_mamba3(hf_config) -> Mamba3ForCausalLM:
    """The model for any HF config carrying the Mamba-3 fields (ours, or MindSpeed's Mamba-2 style one)."""
    return Mamba3ForCausalLM(Mamba3Config.from_any(hf_config))


register_with_transformers()

__all__ = ["Mamba3Config", "Mamba3ForCausalLM", "Mamba3Model", "build_mamba3", "register_with_transformers"]
