"""Megatron's batch-size schedule flags (--rampup-batch-size, --step-batch-size-schedule,
--decrease-batch-size-if-needed → training.*; fsdp2_backend/training/batch_rampup.py), MindSpeed's --o2-optimizer
(training.o2_optimizer; training/o2_adamw.py) and Megatron's --muon-* options (training.muon_*; training/muon.py).
"""
from __future__ import annotations

from megatron_compat.translate_handlers import HANDLERS, _direct, handles

_direct("rampup_batch_size", "training.rampup_batch_size", lambda v: [int(x) for x in v])


@handles("step_batch_size_schedule", "training.step_batch_size_schedule")
def _step_batch_size_schedule(ctx, value):
    if value is None:
        return
    if "global_batch_size" in ctx.active:  # Megatron-LM's own check (arguments.py)
        ctx.decline("step_batch_size_schedule", "Megatron refuses it together with --global-batch-size (the schedule "
                                                "gives every size) — drop --global-batch-size")
    elif "train_iters" in ctx.active:  # config/batch_rules.py: the schedule and data would be sized for the wrong count
        ctx.decline("step_batch_size_schedule", "a growing batch needs sample-based training — replace --train-iters "
                                                "by --train-samples (and --lr-*-iters by --lr-*-samples)")
    else:  # one quoted string, or its words split by the shell (arguments.py lets the flag take several)
        ctx.set("training.step_batch_size_schedule", " ".join(value) if isinstance(value, (list, tuple)) else value)


_direct("decrease_batch_size_if_needed", "training.decrease_batch_size_if_needed")
_direct("o2_optimizer", "training.o2_optimizer")  # MindSpeed's bf16 AdamW moments (training/o2_adamw.py)


# Megatron's Muon (fsdp2_backend/training/muon.py): its options, read only with --optimizer muon.
_MUON_FIELDS = ("muon_momentum", "muon_nesterov", "muon_scale_mode", "muon_coefficient_type", "muon_num_ns_steps",
                "muon_extra_scale_factor", "muon_fp32_matmul_prec")
_MUON_DECLINES = {  # dest: (value that cannot be honoured, why — what to do)
    "muon_split_qkv": (False, "HF models keep q, k and v as separate matrices, each orthogonalised on its own "
                              "(Megatron's default split) — drop --muon-no-split-qkv"),
    "muon_tp_mode": ("blockwise", "blockwise orthogonalises each tensor-parallel shard; here every matrix is "
                                  "orthogonalised whole (duplicated) — use --muon-tp-mode duplicated"),
    "muon_scalar_optimizer": ("lion", "Lion is not available for the non-matrix parameters — use adam"),
    "muon_fp32_matmul_prec": ("low", "'low' has no torch matmul precision here — use medium (bf16) or high (fp32)"),
}


def _muon_handler(dest):
    def handler(ctx, value):
        if ctx.get("optimizer") != "muon":
            ctx.record(dest, "no_effect", "read only by --optimizer muon")
            return
        bad = _MUON_DECLINES.get(dest)
        if bad is not None and value == bad[0] and (dest != "muon_tp_mode" or ctx.get("tensor_model_parallel_size") > 1):
            ctx.decline(dest, bad[1])
        elif dest in _MUON_FIELDS:
            ctx.set(f"training.{dest}", value)
    return handler


for _dest in _MUON_FIELDS + tuple(d for d in _MUON_DECLINES if d not in _MUON_FIELDS) + ("muon_use_syrk",):
    HANDLERS[_dest] = (f"training.{_dest}" if _dest in _MUON_FIELDS else "Megatron's Muon (training/muon.py)",
                       _muon_handler(_dest))
