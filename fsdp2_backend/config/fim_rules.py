"""Validation of the fill-in-the-middle fields (`data.fim_*`, Megatron-LM's `--fim-*` flags), torch-free.

Megatron-LM asserts that FIM has real data (no mock data) and rates; its dataset crashes later on a split token
without a fragment rate. Here each is one line, found with the other config problems. Whether the FIM tokens are
tokens of the tokenizer is checked when the dataset is built (the tokenizer is loaded then).
"""
from __future__ import annotations

from typing import List

# megatron_compat.data.fim_dataset.FIM_TOKEN_ROLES, not imported: that module imports torch
FIM_TOKEN_ROLES = ("prefix", "middle", "suffix", "pad", "eod")


def fim_errors(config) -> List[str]:
    data = config.data
    if not data.fim_data:
        return []
    errors = []
    if data.mock_data:
        errors.append("data.fim_data (--fim-data): Megatron-LM has no FIM over mock data — give --data-path, or "
                      "drop --fim-data")
    if config.training.stage != "pt":
        errors.append("data.fim_data (--fim-data): FIM applies to pretraining data only — drop it for SFT")
    for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(data, name)
        if value is not None and not 0.0 <= value <= 1.0:
            errors.append(f"data.{name} (--{name.replace('_', '-')}): {value} is not a probability — give a "
                          "value in [0, 1]")
    if data.fim_split_sample and data.fim_fragment_rate is None:
        errors.append("data.fim_fragment_rate (--fim-fragment-rate): required with --fim-split-sample (Megatron-LM "
                      "fails on its first split fragment without it) — give a rate in [0, 1]")
    tokens = data.fim_tokens or {}
    missing = [role for role in FIM_TOKEN_ROLES if not tokens.get(role)]
    extra = sorted(set(tokens) - set(FIM_TOKEN_ROLES))
    if missing or extra:
        errors.append(f"data.fim_tokens: needs exactly the keys {', '.join(FIM_TOKEN_ROLES)} (missing: "
                      f"{', '.join(missing) or 'none'}; unknown: {', '.join(extra) or 'none'}) — name each token")
    return errors
