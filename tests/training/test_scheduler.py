"""ParamScheduler against megatron-core's OptimizerParamScheduler (test-only reference) at sampled steps."""
import math
import warnings

import pytest
import torch

from fsdp2_backend.config import TrainingArguments
from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.training.scheduler import ParamScheduler, scheduler_steps

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

GBS = 8


def _opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)


def _reference(kw):
    return OptimizerParamScheduler(
        _opt(), init_lr=kw["init_lr"], max_lr=kw["max_lr"], min_lr=kw["min_lr"],
        lr_warmup_steps=kw["lr_warmup_steps"], lr_decay_steps=kw["lr_decay_steps"],
        lr_decay_style=kw["lr_decay_style"], start_wd=kw["start_wd"], end_wd=kw["end_wd"],
        wd_incr_steps=kw["wd_incr_steps"], wd_incr_style=kw["wd_incr_style"],
        wsd_decay_steps=kw["wsd_decay_steps"], lr_wsd_decay_style=kw["lr_wsd_decay_style"])


def _compare(kw, iters):
    ours, opt = None, _opt()
    ours = ParamScheduler(opt, **kw)
    ref = _reference(kw)
    lrs = []
    for it in range(iters + 5):  # past the end: min_lr
        assert opt.param_groups[0]["lr"] == pytest.approx(ref.optimizer.param_groups[0]["lr"], rel=1e-12, abs=0)
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(
            ref.optimizer.param_groups[0]["weight_decay"], rel=1e-12)
        lrs.append(opt.param_groups[0]["lr"])
        ours.step(GBS)
        ref.step(GBS)
    return lrs


CASES = [
    dict(lr_scheduler_type="cosine", warmup_ratio=0.1),
    dict(lr_scheduler_type="linear", warmup_ratio=0.0, lr_warmup_iters=3, lr_warmup_init=1e-5),
    dict(lr_scheduler_type="constant", warmup_ratio=0.2),
    dict(lr_scheduler_type="inverse-square-root", warmup_ratio=0.0, lr_warmup_iters=4),
    dict(lr_scheduler_type="cosine", warmup_ratio=0.05, lr_decay_iters=30),
] + [dict(lr_scheduler_type="WSD", warmup_ratio=0.1, lr_wsd_decay_style=s, lr_wsd_decay_iters=12)
     for s in ("linear", "cosine", "exponential", "minus_sqrt")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["lr_scheduler_type"] + "-" + c.get("lr_wsd_decay_style", ""))
def test_lr_matches_megatron_by_iterations(case):
    t = TrainingArguments(lr=3e-4, min_lr=3e-5, max_steps=40, weight_decay=0.1, **case)
    lrs = _compare(scheduler_steps(t, GBS), 40)
    assert max(lrs) == pytest.approx(3e-4, rel=1e-2)  # warmup may end between two steps
    if case["lr_scheduler_type"] not in ("constant", "inverse-square-root"):
        assert lrs[-1] == pytest.approx(3e-5)  # decayed to min_lr


def test_lr_matches_megatron_by_samples():
    t = TrainingArguments(lr=1e-3, min_lr=0.0, train_samples=200, lr_warmup_samples=20, warmup_ratio=0.0,
                          lr_decay_samples=150, lr_scheduler_type="WSD", lr_wsd_decay_samples=50)
    kw = scheduler_steps(t, GBS)
    assert (kw["lr_decay_steps"], kw["lr_warmup_steps"], kw["wsd_decay_steps"]) == (150, 20, 50)
    _compare(kw, 200 // GBS)


def test_weight_decay_increment_styles_match_megatron():
    for style in ("linear", "cosine"):
        kw = dict(max_lr=1e-3, min_lr=1e-4, init_lr=0.0, lr_warmup_steps=16, lr_decay_steps=160,
                  lr_decay_style="cosine", wsd_decay_steps=None, lr_wsd_decay_style=None,
                  start_wd=0.01, end_wd=0.1, wd_incr_steps=120, wd_incr_style=style)
        _compare(kw, 20)


def test_no_decay_groups_keep_zero_weight_decay_and_state_roundtrip():
    p1, p2 = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p1], "wd_mult": 1.0}, {"params": [p2], "wd_mult": 0.0}])
    t = TrainingArguments(lr=1e-3, min_lr=1e-4, max_steps=10, weight_decay=0.05)
    sched = ParamScheduler(opt, **scheduler_steps(t, GBS))
    for _ in range(4):
        sched.step(GBS)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    resumed = ParamScheduler(_opt(), **scheduler_steps(t, GBS))
    resumed.load_state_dict(sched.state_dict())
    assert resumed.num_steps == 4 * GBS and resumed.get_lr() == sched.get_lr()
    assert math.isclose(resumed.optimizer.param_groups[0]["lr"], opt.param_groups[0]["lr"])


def test_resume_policies_for_a_changed_schedule():
    old = ParamScheduler(_opt(), **scheduler_steps(TrainingArguments(lr=1e-3, max_steps=10), GBS))
    old.step(3 * GBS)

    def longer(policy):  # the run resumes with twice the training length, under training.lr_scheduler_on_resume
        return ParamScheduler(_opt(), **scheduler_steps(
            TrainingArguments(lr=1e-3, max_steps=20, lr_scheduler_on_resume=policy), GBS))
    with pytest.raises(UsageError) as err:
        longer("check").load_state_dict(old.state_dict())
    # in iterations, as the run was given (--train-iters 10, then 20; global batch 8; warmup ratio 0.03)
    assert err.value.messages == [  # one cause: one line, naming Megatron's flags
        "learning-rate schedule differs from the checkpoint's (lr_warmup_steps: this run 0.6 iterations (4.8 "
        "samples), checkpoint 0.3 iterations (2.4 samples); lr_decay_steps: this run 20 iterations (160 samples), "
        "checkpoint 10 iterations (80 samples); wd_incr_steps: this run 20 iterations (160 samples), checkpoint 10 "
        "iterations (80 samples)) — resume with the same schedule, or add --override-opt_param-scheduler (this run's "
        "schedule wins) or --use-checkpoint-opt_param-scheduler (the checkpoint's wins); natively "
        "training.lr_scheduler_on_resume: override / checkpoint"]
    assert TrainingArguments().lr_scheduler_on_resume == "check"  # Megatron's default
    kept = longer("override")
    kept.load_state_dict(old.state_dict())
    assert kept.lr_decay_steps == 20 * GBS and kept.num_steps == 3 * GBS
    taken = longer("checkpoint")
    taken.load_state_dict(old.state_dict())
    assert taken.lr_decay_steps == 10 * GBS and taken.get_lr() == old.get_lr()


def test_bad_schedule_reports_usage_errors():
    t = TrainingArguments(lr=1e-3, min_lr=1e-2, max_steps=10, warmup_ratio=1.0, lr_scheduler_type="WSD")
    with pytest.raises(UsageError) as err:
        ParamScheduler(_opt(), **scheduler_steps(t, GBS))
    text = "\n".join(err.value.messages)
    assert "min_lr" in text and "warmup" in text and "lr_wsd_decay_iters" in text
    with pytest.raises(UsageError):
        scheduler_steps(TrainingArguments(max_steps=-1), GBS)


def _decoupled_opt():
    """Megatron's groups with --decoupled-lr: default, decoupled with its own min, decoupled with the default min."""
    p = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    return torch.optim.SGD([{"params": [p[0]], "wd_mult": 1.0},
                            {"params": [p[1]], "wd_mult": 1.0, "max_lr": 2e-3, "min_lr": 1e-5},
                            {"params": [p[2]], "wd_mult": 0.0, "max_lr": 5e-4}], lr=0.0)


@pytest.mark.parametrize("case", CASES[:4] + CASES[5:6], ids=lambda c: c["lr_scheduler_type"])
def test_decoupled_lr_groups_match_megatron(case):
    t = TrainingArguments(lr=3e-4, min_lr=3e-5, max_steps=40, weight_decay=0.1, **case)
    kw = scheduler_steps(t, GBS)
    ours = ParamScheduler(_decoupled_opt(), **kw)
    ref = _reference(kw)
    ref.optimizer = _decoupled_opt()  # Megatron's scheduler reads each group's max_lr / min_lr
    ref.step(0)
    for _ in range(45):
        # flat lists: pytest >= 9.2's approx takes no nested structures
        got = [g[key] for g in ours.optimizer.param_groups for key in ("lr", "weight_decay")]
        want = [g[key] for g in ref.optimizer.param_groups for key in ("lr", "weight_decay")]
        assert got == pytest.approx(want, rel=1e-12, abs=0)
        ours.step(GBS)
        ref.step(GBS)
    lrs = [g["lr"] for g in ours.optimizer.param_groups]
    if case["lr_scheduler_type"] == "cosine":
        assert lrs == pytest.approx([3e-5, 1e-5, 3e-5])  # each group ends at its own min_lr
    assert ours.last_lr == lrs[0]


def test_weight_decay_schedule_fields_reach_the_scheduler():
    t = TrainingArguments(lr=1e-3, min_lr=1e-4, max_steps=30, weight_decay=0.5, weight_decay_incr_style="cosine",
                          start_weight_decay=0.01, end_weight_decay=0.1)
    kw = scheduler_steps(t, GBS)
    assert (kw["start_wd"], kw["end_wd"], kw["wd_incr_steps"], kw["wd_incr_style"]) == (0.01, 0.1, 30 * GBS, "cosine")
    _compare(kw, 30)
    by_samples = scheduler_steps(TrainingArguments(train_samples=240, weight_decay_incr_style="linear",
                                                   start_weight_decay=0.0, end_weight_decay=0.2), GBS)
    assert (by_samples["start_wd"], by_samples["end_wd"], by_samples["wd_incr_steps"]) == (0.0, 0.2, 240)
    constant = scheduler_steps(TrainingArguments(max_steps=30, weight_decay=0.05), GBS)
    assert (constant["start_wd"], constant["end_wd"], constant["wd_incr_style"]) == (0.05, 0.05, "constant")
    with pytest.raises(UsageError, match="start_weight_decay"):
        scheduler_steps(TrainingArguments(max_steps=30, weight_decay_incr_style="linear"), GBS)


def test_resume_with_a_changed_decoupled_lr_follows_the_policy():
    t = TrainingArguments(lr=3e-4, min_lr=3e-5, max_steps=40, warmup_ratio=0.1)
    old = ParamScheduler(_decoupled_opt(), **scheduler_steps(t, GBS))
    old.step(10 * GBS)

    def resumed(policy):  # this run asks for decoupled max_lr 1e-3 instead of 2e-3
        t_new = TrainingArguments(lr=3e-4, min_lr=3e-5, max_steps=40, warmup_ratio=0.1,
                                  lr_scheduler_on_resume=policy)
        opt = _decoupled_opt()
        opt.param_groups[1]["max_lr"] = 1e-3
        sched = ParamScheduler(opt, **scheduler_steps(t_new, GBS))
        opt.load_state_dict(old.optimizer.state_dict())  # a resumed optimizer brings the checkpoint's group dicts
        sched.load_state_dict(old.state_dict())
        return sched
    with pytest.raises(UsageError, match="group_lr_bounds"):
        resumed("check")
    override, checkpoint = resumed("override"), resumed("checkpoint")
    assert override.optimizer.param_groups[0]["lr"] == old.optimizer.param_groups[0]["lr"]
    assert checkpoint.optimizer.param_groups[1]["lr"] == old.optimizer.param_groups[1]["lr"]
    # same point of the same schedule shape, between this run's bounds [1e-5, 1e-3] instead of [1e-5, 2e-3]
    assert override.optimizer.param_groups[1]["lr"] == pytest.approx(
        1e-5 + (old.optimizer.param_groups[1]["lr"] - 1e-5) * (1e-3 - 1e-5) / (2e-3 - 1e-5), rel=1e-12)
