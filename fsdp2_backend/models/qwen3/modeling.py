"""Model id `qwen3`: transformers' own Qwen3 causal LM, built from the HF config (no code of this project's)."""
from __future__ import annotations

from torch import nn


def build_qwen3(hf_config) -> nn.Module:
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(hf_config)
