"""The HF config keys of a Megatron-LM checkpoint's saved ``args``, by the same mapping the flags of a run take
(`megatron_compat.architecture.apply`, from scratch): one place maps Megatron's model flags to an HF config,
whether they come from a command line or from a checkpoint.

A saved namespace holds every argparse dest, given or not; the flags "given" are taken to be the dests whose value
differs from Megatron-LM's parser default (its own table, `megatron_lm_arguments.json`), so defaults get the
same disposition as flags left out of a script; the run's training settings (dropouts, init std) are not read.
Declines of given flags come back with their reasons; the checkpoint reader (`megatron_compat.checkpoint.mla`)
refuses the conversion with them. Torch-free, below the checkpoint formats: the parser's table is read by path.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Tuple

from megatron_compat.argument_tables import MEGATRON_TABLE


# How the run trained the model, not what the model is: no checkpoint reader takes them as given (a continuation's own
# flags set them; a conversion holds weights only), so a dropout the HF model type lacks declines nothing here.
_RUN_SETTINGS = frozenset({"hidden_dropout", "attention_dropout", "init_method_std"})




def _given(args: Any) -> set:
    with open(MEGATRON_TABLE, encoding="utf-8") as f:
        defaults = {entry["dest"]: entry["default"] for entry in json.load(f)}
    given = set()
    for dest, value in vars(args).items():
        if dest not in defaults or dest in _RUN_SETTINGS:
            continue
        default = defaults[dest]
        if isinstance(value, tuple):
            value = list(value)
        if value != default:
            given.add(dest)
    return given


def hf_keys_from_saved_args(args: Any) -> Tuple[Dict[str, Any], List[Tuple[str, str]]]:
    """(HF config keys with ``model_type``, [(dest, why) declined]) for a saved Megatron-LM args namespace."""
    from megatron_compat import architecture

    declined: List[Tuple[str, str]] = []

    def record(dest: str, kind: str, text: str) -> None:
        if kind == "declined":
            declined.append((dest, text))

    keys = architecture.apply(args, _given(args), True, record, lambda dest, target, value: None)
    return keys, declined


__all__ = ["hf_keys_from_saved_args"]
