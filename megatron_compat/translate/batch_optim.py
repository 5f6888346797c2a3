"""Megatron's optimizer flags (--optimizer, --decoupled-min-lr, the weight-decay schedule, the scheduler-on-resume
choice), its batch-size schedule flags (--rampup-batch-size, --step-batch-size-schedule,
--decrease-batch-size-if-needed → training.*; fsdp2_backend/config/batch_schedule.py), MindSpeed's --o2-optimizer
(training.o2_optimizer; training/o2_adamw.py), Megatron's --muon-* options (training.muon_*; training/muon.py) and
the evaluation's batch size (--eval-global-batch-size → training.eval_iters in global batches).
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import HANDLERS, _direct, handles

# --- optimizer -------------------------------------------------------------------------------------------------
_OPTIMIZERS = {"adam": "adamw", "muon": "muon"}  # Megatron's adam is AdamW (decoupled weight decay)


@handles("optimizer", "training.optimizer (adam → adamw, muon)")
def _optimizer(ctx, value):
    if value in _OPTIMIZERS:
        ctx.set("training.optimizer", _OPTIMIZERS[value])
    else:
        ctx.decline("optimizer", f"'{value}' is not available — use adam (AdamW) or muon")


@handles("decoupled_min_lr", "training.decoupled_min_lr")
def _decoupled_min_lr(ctx, value):
    if value is None:
        return
    if ctx.get("decoupled_lr") is None:  # Megatron applies it only to the decoupled-lr groups
        ctx.record("decoupled_min_lr", "no_effect", "Megatron reads it only with --decoupled-lr (then it maps "
                                                    "to training.decoupled_min_lr)")
    else:
        ctx.set("training.decoupled_min_lr", value)


@handles("weight_decay_incr_style", "training.weight_decay_incr_style")
def _wd_incr_style(ctx, value):
    """Megatron's validate_args: constant takes --weight-decay and refuses start/end; linear/cosine need both."""
    ctx.set("training.weight_decay_incr_style", value)
    start, end = ctx.get("start_weight_decay"), ctx.get("end_weight_decay")
    if value == "constant":
        for dest in ("start_weight_decay", "end_weight_decay"):
            if ctx.get(dest) is not None:
                ctx.decline(dest, f"maps to training.{dest} only with --weight-decay-incr-style linear or cosine "
                                  "(Megatron refuses it with the constant style) — add the style, or drop it "
                                  "(constant uses --weight-decay)")
    elif start is None or end is None:
        ctx.decline("weight_decay_incr_style", f"'{value}' maps to training.weight_decay_incr_style with "
                                               "--start-weight-decay and --end-weight-decay (Megatron needs both) — "
                                               "give both")
    elif not 0.0 <= start <= end:
        ctx.decline("start_weight_decay", f"{start} must lie in [0, --end-weight-decay {end}] — weight decay can "
                                          "only increase")


_ON_RESUME = {"override_opt_param_scheduler": "override", "use_checkpoint_opt_param_scheduler": "checkpoint"}
for _dest in _ON_RESUME:
    @handles(_dest, f"training.lr_scheduler_on_resume {_ON_RESUME[_dest]}")
    def _on_resume(ctx, value, _dest=_dest):
        chosen = [dest for dest in _ON_RESUME if ctx.get(dest)]
        if len(chosen) > 1:
            ctx.decline(_dest, "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are "
                               "exclusive — keep one")
        ctx.set("training.lr_scheduler_on_resume", _ON_RESUME[chosen[0]] if len(chosen) == 1 else "check")


_direct("rampup_batch_size", "training.rampup_batch_size", lambda v: [int(x) for x in v])


@handles("step_batch_size_schedule", "training.step_batch_size_schedule")
def _step_batch_size_schedule(ctx, value):
    if value is None:
        return
    if "global_batch_size" in ctx.active:  # Megatron-LM's own check (arguments.py)
        ctx.decline("step_batch_size_schedule", "Megatron-LM refuses it together with --global-batch-size too "
                                                "(\"Cannot specify both --step-batch-size-schedule and "
                                                "--global-batch-size\": the schedule gives every size) — drop "
                                                "--global-batch-size")
    elif "train_iters" in ctx.active:  # config/rules/training.py: the schedule and data would be sized for the wrong count
        ctx.decline("step_batch_size_schedule", "a growing batch needs sample-based training — replace --train-iters "
                                                "by --train-samples (and --lr-*-iters by --lr-*-samples)")
    else:  # one quoted string, or its words split by the shell (arguments.py lets the flag take several)
        ctx.set("training.step_batch_size_schedule", " ".join(value) if isinstance(value, (list, tuple)) else value)


@handles("eval_global_batch_size", "training.eval_iters (× --eval-global-batch-size / --global-batch-size)")
def _eval_global_batch_size(ctx, value):
    """Megatron evaluates --eval-iters batches of --eval-global-batch-size samples, the loss token-weighted over
    all of them; here an evaluation reads global batches: the same samples, in the same order, are
    eval_iters × eval_gbs / gbs of them, and the token-weighted loss over them is the same number."""
    if value is None:
        return
    gbs, iters = ctx.get("global_batch_size"), ctx.get("eval_iters")
    if gbs is None:
        ctx.decline("eval_global_batch_size", "the evaluation is read in global batches here, whose size Megatron "
                                              "derives from the world size without --global-batch-size — give it")
    elif (value * iters) % gbs:
        ctx.decline("eval_global_batch_size", f"--eval-iters {iters} × {value} samples is not a whole number of "
                                              f"global batches of {gbs} (evaluation reads global batches here) — "
                                              f"use an --eval-global-batch-size whose eval-iters multiple divides "
                                              f"by {gbs}")
    else:
        ctx.set("training.eval_iters", value * iters // gbs)


@handles("eval_micro_batch_size", "(no effect: the evaluation's micro-batch split)")
def _eval_micro_batch_size(ctx, value):
    if value is not None:
        ctx.record("eval_micro_batch_size", "no_effect", "the evaluation's split into micro-batches changes no "
                                                         "result (its loss is token-weighted over every sample)")


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
