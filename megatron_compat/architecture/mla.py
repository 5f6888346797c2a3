"""Megatron's YaRN flags of multi-latent attention → transformers' DeepSeek-V3 `rope_scaling`, from scratch.

megatron-core builds an MLA model with `MLATransformerConfig`, whose rotary embedding is YaRN
(`YarnRotaryEmbedding`): inverse frequencies blended between the extrapolated and the interpolated (divided by
the scaling factor) ones over the correction range found from `beta_fast` / `beta_slow` and the original
context length; cos/sin multiplied by the concentration factor mscale(factor, mscale) / mscale(factor,
mscale_all_dim); and the softmax scale multiplied by mscale(factor, mscale_all_dim)². transformers' DeepSeek-V3
does the same from `rope_parameters` of type "yarn" — except that, with `mscale_all_dim` 0 (Megatron's default),
it infers a different concentration factor, so Megatron's is passed explicitly as `attention_factor`.

The flags, Megatron-LM's and MindSpeed-LLM's spellings: `--rotary-scaling-factor` / `--rope-scaling-factor`,
`--mscale` / `--rope-scaling-mscale`, `--mscale-all-dim` / `--rope-scaling-mscale-all-dim`, `--beta-fast` /
`--beta-slow` (and `--rope-scaling-beta-*`), `--rope-scaling-original-max-position-embeddings` /
`--original-max-position-embeddings` / `--yarn-original-max-position-embeddings`,
`--no-yarn-correction-range-round-to-int`; unset ones take megatron-core's `MLATransformerConfig` defaults
(factor 1, mscale 1, mscale_all_dim 0, beta 32 / 1, original context 4096). With none of them given the
model keeps plain RoPE, which is what YaRN with factor 1 computes. `--rope-type rope` or another
`--rope-scaling-type` leaves these flags to the generic disposition (declined from scratch).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

# (HF rope_parameters key, Megatron's default, the flags that set it — first active one wins)
_YARN: Tuple[Tuple[str, object, Tuple[str, ...]], ...] = (
    ("factor", 1.0, ("rotary_scaling_factor", "rope_scaling_factor")),
    ("mscale", 1.0, ("mscale", "rope_scaling_mscale")),
    ("mscale_all_dim", 0.0, ("mscale_all_dim", "rope_scaling_mscale_all_dim")),
    ("beta_fast", 32.0, ("beta_fast", "rope_scaling_beta_fast", "yarn_beta_fast")),
    ("beta_slow", 1.0, ("beta_slow", "rope_scaling_beta_slow", "yarn_beta_slow")),
    ("original_max_position_embeddings", 4096, ("rope_scaling_original_max_position_embeddings",
                                                "original_max_position_embeddings",
                                                "yarn_original_max_position_embeddings")),
)
_SELECTORS = ("rope_type", "rope_scaling_type", "yarn_correction_range_round_to_int")
YARN_DESTS = frozenset(d for _, _, dests in _YARN for d in dests) | frozenset(_SELECTORS)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction (megatron-core's `_yarn_get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_rope_scaling(ns, active) -> Optional[Dict]:
    """The `rope_scaling` dict for the active YaRN flags, or None when none is given or YaRN is not asked."""
    given = YARN_DESTS & set(active)
    if not given:
        return None
    if getattr(ns, "rope_type", None) not in (None, "yarn"):
        return None
    if getattr(ns, "rope_scaling_type", None) not in (None, "yarn"):
        return None
    params: Dict = {"rope_type": "yarn"}
    for key, default, dests in _YARN:
        value = next((getattr(ns, d) for d in dests if d in given and getattr(ns, d, None) is not None), default)
        params[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    # megatron-core's concentration factor, also when mscale_all_dim is 0 (transformers would infer another)
    params["attention_factor"] = (yarn_mscale(params["factor"], params["mscale"])
                                  / yarn_mscale(params["factor"], params["mscale_all_dim"]))
    if "yarn_correction_range_round_to_int" in given:
        params["truncate"] = bool(ns.yarn_correction_range_round_to_int)
    return params


def apply_yarn(a) -> None:
    """Sets `rope_scaling` of a from-scratch DeepSeek-V3 build and records every YaRN flag as mapped."""
    if not a.from_scratch:
        return
    params = yarn_rope_scaling(a.ns, a.active)
    if params is None:
        return
    a.keys["rope_scaling"] = params
    for dest in sorted(YARN_DESTS & set(a.active)):
        a.note(dest, "mapped", "model.architecture.rope_scaling (yarn)")
