"""Learning-rate and weight-decay schedule with Megatron's semantics, counted in SAMPLES.

Owns `ParamScheduler` (the formulas of megatron/core/optimizer_param_scheduler.py: linear warmup from
`lr_warmup_init`, then constant / linear / cosine / inverse-square-root / WSD decay down to `min_lr`, plus the
weight-decay increment styles) and `scheduler_steps`, which turns the training arguments into sample counts the
way Megatron's `get_optimizer_param_scheduler` does. Written here (not imported) because megatron-core is a
test-only reference; the test compares the two at sampled steps.

Use: `sched = ParamScheduler(optimizer, **scheduler_steps(training, global_batch_size))`, then after every
successful iteration `sched.step(global_batch_size)` (Megatron advances by the global batch in samples; a
skipped iteration does not advance). Each param group's `lr` is set to the schedule and its `weight_decay` to
the schedule times the group's `wd_mult` (0.0 for Megatron's no-decay group, see optimizer.py). A group carrying
`max_lr` / `min_lr` (Megatron's decoupled lr for the embedding and output layer) follows the same schedule
between its own bounds, as in Megatron's `get_lr(param_group)`. The bounds are read once, at construction, and
kept in the scheduler's state (`group_lr_bounds`): a resumed optimizer brings back its checkpoint's group dicts,
so reading them again would silently take the checkpoint's decoupled lr; here `on_resume` decides, as for the
other schedule values.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from fsdp2_backend.usage_errors import UsageError

LR_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_STYLES = ("constant", "linear", "cosine")
# What load_state_dict does with schedule values that differ from the constructor's (Megatron's flags):
# "check" refuses a mismatch (Megatron's default), "checkpoint" takes the checkpoint's
# (--use-checkpoint-opt-param-scheduler), "override" keeps the constructor's (--override-opt-param-scheduler).
RESUME_POLICIES = ("check", "checkpoint", "override")
_SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_style", "lr_decay_steps", "start_wd", "end_wd",
                  "wd_incr_style", "wd_incr_steps", "group_lr_bounds")


class ParamScheduler:
    """Sets lr and weight decay on every param group of `optimizer` from the number of samples consumed.

    Step counts (`lr_warmup_steps`, `lr_decay_steps`, `wsd_decay_steps`, `wd_incr_steps`) are in samples.
    `optimizer` is anything with a `param_groups` list of dicts (a torch optimizer or `CombinedOptimizer`); a
    group's own `max_lr` / `min_lr` (read here, once) replace the constructor's for that group. `on_resume` (see RESUME_POLICIES)
    defaults to Megatron's "check" (training.lr_scheduler_on_resume).
    """

    def __init__(self, optimizer: Any, *, max_lr: float, min_lr: float, lr_warmup_steps: float,
                 lr_decay_steps: int, lr_decay_style: str, init_lr: float = 0.0,
                 wsd_decay_steps: Optional[int] = None, lr_wsd_decay_style: str = "exponential",
                 start_wd: float = 0.0, end_wd: Optional[float] = None, wd_incr_steps: int = 1,
                 wd_incr_style: str = "constant", on_resume: str = "check",
                 samples_per_iteration: Optional[int] = None):
        # a run given in iterations (the global batch): a resume mismatch is reported in iterations too
        self.samples_per_iteration = samples_per_iteration
        end_wd = start_wd if end_wd is None else end_wd
        problems = []
        if lr_decay_style not in LR_STYLES:
            problems.append(f"lr_scheduler_type: unknown style {lr_decay_style!r} — use one of {LR_STYLES}")
        if lr_decay_style == "WSD" and lr_wsd_decay_style not in WSD_STYLES:
            problems.append(f"lr_wsd_decay_style: unknown style {lr_wsd_decay_style!r} — use one of {WSD_STYLES}")
        if lr_decay_style == "WSD" and wsd_decay_steps is None:
            problems.append("lr_wsd_decay_iters: WSD needs the anneal length — set lr_wsd_decay_iters "
                            "(or lr_wsd_decay_samples when training by samples)")
        if wd_incr_style not in WD_STYLES:
            problems.append(f"weight decay increment style: unknown {wd_incr_style!r} — use one of {WD_STYLES}")
        if not 0.0 <= min_lr <= max_lr:
            problems.append(f"min_lr: {min_lr} must lie in [0, lr={max_lr}] — lower min_lr")
        if init_lr > max_lr:
            problems.append(f"lr_warmup_init: {init_lr} exceeds lr={max_lr} — lower lr_warmup_init")
        if lr_decay_steps <= 0:
            problems.append(f"lr_decay_iters: the decay length is {lr_decay_steps} samples — it must be "
                            "positive (set max_steps / train_samples or lr_decay_iters / lr_decay_samples)")
        elif lr_warmup_steps >= lr_decay_steps:
            problems.append(f"warmup_ratio / lr_warmup_iters: warmup ({lr_warmup_steps} samples) must be "
                            f"shorter than the decay ({lr_decay_steps} samples) — shorten the warmup")
        if not 0.0 <= start_wd <= end_wd:
            problems.append(f"weight decay: need 0 <= start ({start_wd}) <= end ({end_wd})")
        if wd_incr_style == "constant" and start_wd != end_wd:
            problems.append("weight decay: constant style needs start == end — pick linear or cosine")
        if on_resume not in RESUME_POLICIES:
            problems.append(f"scheduler resume policy: unknown {on_resume!r} — use one of {RESUME_POLICIES}")
        if problems:
            raise UsageError(problems)
        self.optimizer, self.on_resume = optimizer, on_resume
        self.max_lr, self.min_lr, self.init_lr = float(max_lr), float(min_lr), float(init_lr)
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps, self.lr_wsd_decay_style = wsd_decay_steps, lr_wsd_decay_style
        self.start_wd, self.end_wd = float(start_wd), float(end_wd)
        self.wd_incr_steps, self.wd_incr_style = max(int(wd_incr_steps), 1), wd_incr_style
        # [max_lr, min_lr] per param group (None: the constructor's value); None when no group has its own.
        bounds = [[g.get("max_lr"), g.get("min_lr")] for g in optimizer.param_groups]
        self.group_lr_bounds = bounds if any(v is not None for pair in bounds for v in pair) else None
        self.num_steps = 0
        self.step(0)

    def get_lr(self, group: Optional[int] = None) -> float:
        """The learning rate after `num_steps` samples (Megatron's formula, branch for branch): the default
        schedule, or param group `group`'s, between its own `max_lr` / `min_lr` when it has them."""
        bounds = self.group_lr_bounds
        own_max, own_min = bounds[group] if bounds and group is not None and group < len(bounds) else (None, None)
        max_lr = self.max_lr if own_max is None else own_max
        min_lr = self.min_lr if own_min is None else own_min
        n, warmup, decay = self.num_steps, self.lr_warmup_steps, self.lr_decay_steps
        if warmup > 0 and n <= warmup:
            return self.init_lr + (max_lr - self.init_lr) * float(n) / float(warmup)
        if self.lr_decay_style == "constant":
            return max_lr
        if n > decay:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(n, 1) ** 0.5)
        ratio = float(n - warmup) / float(decay - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable at max_lr until the last wsd_decay_steps, then anneal
            anneal_start = decay - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                wsd_ratio = float(n - anneal_start) / float(self.wsd_decay_steps)
                coeff = {"linear": lambda r: 1.0 - r,
                         "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: 2.0 * math.pow(0.5, r) - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.lr_wsd_decay_style](wsd_ratio)
        return min_lr + coeff * (max_lr - min_lr)

    def get_wd(self) -> float:
        """The weight decay after `num_steps` samples (before a group's `wd_mult`)."""
        if self.num_steps > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = float(self.num_steps) / float(self.wd_incr_steps)
        coeff = ratio if self.wd_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def step(self, increment: int) -> None:
        """Advances by `increment` samples (the global batch size) and writes lr / weight_decay to the groups."""
        self.num_steps += increment
        wd = self.get_wd()
        for index, group in enumerate(self.optimizer.param_groups):
            group["lr"] = self.get_lr(index)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    def _count(self, key: str, value: Any) -> str:
        """A schedule value as the user gave it: a step count in iterations (and samples) when the run is given in
        iterations, else as stored."""
        per = self.samples_per_iteration
        if key.endswith("_steps") and per and isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{value / per:g} iterations ({value:g} samples)"
        return repr(value)

    @property
    def last_lr(self) -> float:
        """The learning rate of the default schedule (what Megatron's log line reports)."""
        return self.get_lr()

    def state_dict(self) -> Dict[str, Any]:
        """Megatron's keys, so a checkpoint records the same schedule facts."""
        return {"num_steps": self.num_steps, **{k: getattr(self, k) for k in _SCHEDULE_KEYS}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores the position (`num_steps`) and, per `on_resume`, the schedule values."""
        mismatched = [f"{k}: this run {self._count(k, getattr(self, k))}, checkpoint {self._count(k, state[k])}"
                      for k in _SCHEDULE_KEYS if k in state and state[k] != getattr(self, k)]
        if mismatched and self.on_resume == "check":  # one cause, one line; Megatron's flags first
            raise UsageError(f"learning-rate schedule differs from the checkpoint's ({'; '.join(mismatched)}) — "
                             "resume with the same schedule, or add --override-opt_param-scheduler (this run's "
                             "schedule wins) or --use-checkpoint-opt_param-scheduler (the checkpoint's wins); "
                             "natively training.lr_scheduler_on_resume: override / checkpoint")
        if self.on_resume == "checkpoint":
            for key in _SCHEDULE_KEYS:
                if key in state:
                    setattr(self, key, state[key])
        self.num_steps = 0
        self.step(int(state["num_steps"]))


def scheduler_steps(training: Any, global_batch_size: int, train_iters: Optional[int] = None) -> Dict[str, Any]:
    """Keyword arguments for `ParamScheduler` from TrainingArguments, as Megatron derives them.

    By iterations (`max_steps` > 0): decay = (lr_decay_iters or max_steps) × gbs; warmup = lr_warmup_iters ×
    gbs when set, else warmup_ratio × decay; WSD anneal = lr_wsd_decay_iters × gbs. By samples
    (`train_samples`): the *_samples fields, same rules. Weight decay: constant `weight_decay`, or from
    `start_weight_decay` to `end_weight_decay` over the whole run (`weight_decay_incr_style` linear / cosine;
    Megatron's wd_incr_steps = train_iters × gbs or train_samples). `on_resume` is `lr_scheduler_on_resume`.
    `train_iters` stands in for max_steps when the trainer derived the length from num_train_epochs.
    Megatron forbids setting both a warmup fraction and warmup iters; the translator should set
    warmup_ratio to 0 when a script gives --lr-warmup-iters/-samples (here the explicit count wins).
    """
    t = training
    if getattr(t, "train_samples", None):
        decay = t.lr_decay_samples or t.train_samples
        explicit_warmup = t.lr_warmup_samples
        wsd = t.lr_wsd_decay_samples
        wd_steps = t.train_samples
    elif (t.max_steps and t.max_steps > 0) or train_iters:
        iters = t.max_steps if t.max_steps and t.max_steps > 0 else train_iters
        decay = (t.lr_decay_iters or iters) * global_batch_size
        explicit_warmup = t.lr_warmup_iters * global_batch_size
        wsd = t.lr_wsd_decay_iters * global_batch_size if t.lr_wsd_decay_iters is not None else None
        wd_steps = iters * global_batch_size
    else:
        raise UsageError("max_steps: the schedule needs a training length — set max_steps (--train-iters) "
                         "or train_samples (--train-samples), or let the trainer derive max_steps from epochs")
    warmup = explicit_warmup if explicit_warmup else t.warmup_ratio * decay
    style = t.weight_decay_incr_style
    if style == "constant":  # Megatron: start and end are both --weight-decay
        start_wd = end_wd = t.weight_decay
    else:
        if t.start_weight_decay is None or t.end_weight_decay is None:
            raise UsageError(f"training.start_weight_decay / end_weight_decay: weight_decay_incr_style {style} "
                             "needs both — set them, or use the constant style")
        start_wd, end_wd = t.start_weight_decay, t.end_weight_decay
    return dict(max_lr=t.lr, min_lr=t.min_lr, init_lr=t.lr_warmup_init, lr_warmup_steps=warmup,
                lr_decay_steps=decay, lr_decay_style=t.lr_scheduler_type, wsd_decay_steps=wsd,
                lr_wsd_decay_style=t.lr_wsd_decay_style, start_wd=start_wd, end_wd=end_wd,
                wd_incr_steps=wd_steps, wd_incr_style=style, on_resume=t.lr_scheduler_on_resume,
                samples_per_iteration=None if getattr(t, "train_samples", None) else global_batch_size)
