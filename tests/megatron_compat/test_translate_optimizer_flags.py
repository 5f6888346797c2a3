"""Megatron's optimizer-schedule flags (`megatron_compat/translate/batch_optim.py`): decoupled LR, weight-decay
schedule, scheduler-on-resume choice, and the combinations Megatron's validate_args refuses."""
import pytest

from megatron_compat.translate import translate_megatron, translate_report
from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS
from fsdp2_backend.usage_errors import UsageError


def test_optimizer_schedule_flags():
    argv = TRANSLATE_BASE_FLAGS + ("--decoupled-lr 5e-4 --decoupled-min-lr 5e-5 --apply-wd-to-qk-layernorm --exit-duration-in-mins 90 "
                   "--weight-decay-incr-style cosine --start-weight-decay 0.01 --end-weight-decay 0.1 "
                   "--override-opt_param-scheduler").split()
    t = translate_megatron(argv).fields["training"]
    assert (t["decoupled_lr"], t["decoupled_min_lr"], t["apply_wd_to_qk_layernorm"], t["exit_duration_in_mins"]) == \
        (5e-4, 5e-5, True, 90.0)
    assert (t["weight_decay_incr_style"], t["start_weight_decay"], t["end_weight_decay"]) == ("cosine", 0.01, 0.1)
    assert t["lr_scheduler_on_resume"] == "override"
    assert translate_megatron(TRANSLATE_BASE_FLAGS + ["--use-checkpoint-opt-param-scheduler"]).fields["training"][
        "lr_scheduler_on_resume"] == "checkpoint"
    assert translate_megatron(TRANSLATE_BASE_FLAGS).fields["training"]["lr_scheduler_on_resume"] == "check"  # Megatron's default
    # Megatron ignores --decoupled-min-lr without --decoupled-lr.
    report = translate_report(TRANSLATE_BASE_FLAGS + ["--decoupled-min-lr", "1e-5"])
    assert "--decoupled-min-lr" in report.report.no_effect and "decoupled_min_lr" not in report.fields["training"]


@pytest.mark.parametrize("extra, flag", [
    ("--start-weight-decay 0.1", "--start-weight-decay"),  # constant style refuses start/end (validate_args)
    ("--weight-decay-incr-style linear --end-weight-decay 0.1", "--weight-decay-incr-style"),  # needs both
    ("--weight-decay-incr-style linear --start-weight-decay 0.2 --end-weight-decay 0.1", "--start-weight-decay"),
    ("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler"),
])
def test_optimizer_schedule_flags_megatron_refuses_are_declined(extra, flag):
    with pytest.raises(UsageError) as err:
        translate_megatron(TRANSLATE_BASE_FLAGS + extra.split())
    assert any(m.startswith(flag + ":") and " — " in m for m in err.value.messages), err.value.messages
