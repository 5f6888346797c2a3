"""Megatron-FSDP's ``--ckpt-format fsdp_dtensor`` saves read back into the forms the other Megatron-LM formats give:
the model per layer in Megatron's names (as ``torch_dcp`` / legacy ones), the Adam state per parameter name.

Layout facts (Megatron-LM ``megatron/training/checkpointing.py``: ``generate_state_dict``,
``preprocess_fsdp_dtensor_state_dict``, ``get_rng_state``; megatron-core 0.16.1
``transformer/fsdp_dtensor_checkpoint.py``, ``optimizer/distrib_optimizer.py``
``sharded_param_state_fsdp_dtensor``, ``distributed/fsdp/mcore_fsdp_adapter.py``; and its
``tools/checkpoint/checkpoint_inspector.py``, which writes the same layout from torch_dist):

- The files are one ``torch.distributed.checkpoint.save`` of the whole dict (DCP only, as ``torch_dcp``: read by
  `dcp_format`), told apart by the saved args (``ckpt_format == "fsdp_dtensor"`` / ``use_megatron_fsdp``).
- ``model``: the Megatron-FSDP wrapper's ``state_dict()``, so every key carries the wrapper's ``module.`` prefix
  (``model.module.decoder.layers.0...``); tensors are DTensors (uneven shards allowed), stored as global tensors.
- ``--swiglu``: every gated ``linear_fc1.weight`` / ``.bias`` (dense, ``shared_experts``, experts
  ``local_experts.{e}.linear_fc1.weight`` or grouped ``linear_fc1.weight{e}``) is split into ``KEY_w`` (the gate
  half) and ``KEY_v`` (the up half), each a global tensor over the tensor-parallel ranks: ``[w; v]`` is the
  unsplit ``[gate; up]`` whatever the TP size.
- ``--num-experts``: expert indices in the keys are global (``handle_experts_in_state_dict``).
- ``_extra_state`` entries are dropped before saving.
- ``optimizer``: ``{"state": {NAME: {"exp_avg", "exp_avg_sq", "step"}}, "param_to_group_meta": {NAME: group
  settings}}`` where NAME is the parameter's name in the wrapped model chunk (``module.module.`` — or
  ``module.module.module.`` under a Float16Module — then Megatron's name; gated fc1 moments split like the weights,
  ``step`` copied to both halves). Megatron-FSDP's parameters are the fp32 main weights: no separate ``param``.
- ``rng_state``: ``{"(pp_rank, tp_rank)": [per-data-parallel-rank RNG dicts]}``; ``opt_param_scheduler``,
  ``iteration``, ``args`` as in the other formats.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from fsdp2_backend.usage_errors import UsageError

_HALF = re.compile(r"^(?P<base>.*\.linear_fc1\.(?:weight|bias)\d*)_(?P<half>[wv])$")


def is_fsdp_dtensor(args: Any) -> bool:
    """Megatron-LM's own test (``_get_checkpoint_format``): a DCP save of a run with ``--use-megatron-fsdp``."""
    return getattr(args, "ckpt_format", None) == "fsdp_dtensor" or bool(getattr(args, "use_megatron_fsdp", False))


def _strip(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def join_halves(tensors: dict, where: Any = "the checkpoint") -> dict:
    """{Megatron name: tensor} with the wrapper prefixes gone and each ``_w`` / ``_v`` pair joined to ``[w; v]``
    (works on meta tensors: shapes only)."""
    out, halves = {}, {}
    for key, value in tensors.items():
        key = _strip(key)
        match = _HALF.match(key)
        if match is None:
            out[key] = value
        else:
            halves.setdefault(match["base"], {})[match["half"]] = value
    for base, pair in halves.items():
        if set(pair) != {"w", "v"}:
            raise UsageError(f"{where}: {base} has only its '_{''.join(pair)}' half in this Megatron-FSDP checkpoint "
                             f"— a partial save? Not read")
        out[base] = torch.cat([pair["w"], pair["v"]], dim=0)
    return out


def model_state(model: dict) -> dict:
    """The model entries of an fsdp_dtensor save in the per-layer legacy form (`dcp_format` gives the rest)."""
    return join_halves({k: v for k, v in model.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k})


def optimizer_state(optimizer: Any, where: Path) -> tuple[dict, int]:
    """({exp_avg / exp_avg_sq / param: {Megatron name: tensor}}, the one Adam step) of an fsdp_dtensor save;
    ``param`` stays empty (the weights are the fp32 main weights)."""
    state = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not state:
        raise UsageError(f"{where}: a Megatron-FSDP checkpoint saved without its optimizer state (--no-save-optim) "
                         f"— resume with --no-load-optim")
    out: dict[str, dict] = {"exp_avg": {}, "exp_avg_sq": {}, "param": {}}
    steps = set()
    for name, entry in state.items():
        if not isinstance(entry, dict) or "exp_avg" not in entry or "exp_avg_sq" not in entry:
            raise UsageError(f"{where}: the optimizer state of {name} holds no Adam exp_avg / exp_avg_sq (another "
                             f"optimizer's state is not mapped) — resume with --no-load-optim")
        for kind in ("exp_avg", "exp_avg_sq"):
            out[kind][name] = entry[kind]
        if "step" in entry:
            steps.add(int(entry["step"]))
    if len(steps) != 1:
        raise UsageError(f"{where}: the optimizer's step is {sorted(steps) or 'missing'} — one Adam step shared by "
                         f"all parameters is needed; resume with --no-load-optim")
    return {kind: join_halves(v, where) if v else {} for kind, v in out.items()}, steps.pop()


def rng_entries(rng: Any) -> Any:
    """The RNG list of the first (pipeline, tensor) rank from fsdp_dtensor's ``{"(pp, tp)": [...]}``."""
    if isinstance(rng, dict) and rng and all(isinstance(k, str) and k.startswith("(") for k in rng):
        return rng["(0, 0)"] if "(0, 0)" in rng else rng[sorted(rng)[0]]
    return rng


__all__ = ["is_fsdp_dtensor", "join_halves", "model_state", "optimizer_state", "rng_entries"]
