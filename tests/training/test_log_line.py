"""The training / validation lines against a regex written here from Megatron's format (shared/megatron/FACTS.md),
independently of the module's own `MegatronLogLine`, plus TrainLogger's accumulation rules."""
import math
import re
from datetime import datetime

import torch

from fsdp2_backend.training.logging import (MegatronLogLine, TrainLogger, format_train_line,
                                            format_validation_lines, parse_train_line)

# FACTS.md: each field followed by " |"; iteration and train_iters right-aligned in 8, consumed samples in 12,
# elapsed one decimal, lr %.6E, global batch size in 5, "lm loss" %.6E, loss scale one decimal, grad norm three
# decimals, skipped / nan counts right-aligned in 3.
FACTS_LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{6}\]"
    r" iteration (?P<it>[ \d]{8})/(?P<total>[ \d]{8}) \|"
    r" consumed samples: (?P<consumed>[ \d]{12}) \|"
    r" elapsed time per iteration \(ms\): (?P<ms>\d+\.\d) \|"
    r" learning rate: (?P<lr>\d\.\d{6}E[-+]\d\d) \|"
    r" global batch size: (?P<gbs>[ \d]{5}) \|"
    r" lm loss: (?P<loss>\d\.\d{6}E[-+]\d\d) \|"
    r" loss scale: (?P<scale>\d+\.\d) \|"
    r" grad norm: (?P<gn>\d+\.\d{3}) \|"
    r" number of skipped iterations: (?P<skipped>[ \d]{3}) \|"
    r" number of nan iterations: (?P<nan>[ \d]{3}) \|")


def _line(**kw):
    values = dict(iteration=12, train_iters=1000, consumed_samples=384, elapsed_ms=1234.56,
                  learning_rate=2.5e-4, global_batch_size=32, losses={"lm loss": 7.123456789}, loss_scale=1.0,
                  grad_norm=3.14159, skipped_iterations=0, nan_iterations=1, tokens_per_sec_per_device=4096.25,
                  peak_memory_gib=1.5, now=datetime(2026, 12, 2, 17, 5, 9, 123456))
    values.update(kw)
    return format_train_line(**values)


def test_line_matches_megatrons_format_from_facts():
    line = _line()
    m = FACTS_LINE.match(line)
    assert m, line
    assert line.startswith(" [2026-12-02 17:05:09.123456] iteration       12/    1000 |")
    assert m["consumed"] == "         384" and m["gbs"] == "   32" and m["nan"] == "  1"
    assert (m["ms"], m["lr"], m["loss"], m["scale"], m["gn"]) == ("1234.6", "2.500000E-04", "7.123457E+00",
                                                                  "1.0", "3.142")
    # our additions come after Megatron's last field
    assert line[m.end():] == " tokens per second per device: 4096.2 | peak memory per device (GiB): 1.50 |"


def test_module_regex_parses_our_line_and_optional_megatron_fields():
    parsed = parse_train_line(_line(tflops_per_device=12.34, params_norm=100.0, num_zeros=3))
    assert parsed["iteration"] == 12 and parsed["train_iters"] == 1000 and parsed["consumed_samples"] == 384
    assert parsed["losses"] == {"lm loss": 7.123457} and parsed["grad_norm"] == 3.142
    assert parsed["tflops"] == 12.3 and parsed["num_zeros"] == 3 and parsed["params_norm"] == 100.0
    assert parse_train_line(_line(grad_norm=None, losses={"lm loss": 1.0, "load balancing loss": 0.5}))["losses"] \
        == {"lm loss": 1.0, "load balancing loss": 0.5}
    assert MegatronLogLine.match(" validation loss at iteration 5 | lm loss value: 1.0E+00 |") is None


def test_validation_block_is_megatrons():
    rule, line, rule2 = format_validation_lines(20, {"lm loss": 2.0})
    assert line == " validation loss at iteration 20 | lm loss value: 2.000000E+00 | lm loss PPL: 7.389056E+00 | "
    assert rule == rule2 == "-" * (len(line) + 1)
    assert format_validation_lines(1, {"lm loss": 30.0})[1].endswith(f"lm loss PPL: {math.exp(20):.6E} | ")


def test_logger_averages_advanced_iterations_and_counts_skipped_and_nan():
    printed = []
    logger = TrainLogger(train_iters=10, log_interval=3, global_batch_size=4, world_size=2,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=4 * 16,
                         print_fn=printed.append)
    common = dict(learning_rate=1e-3, grad_norm=0.5, consumed_samples=0)
    assert logger.record(1, losses={"lm loss": 2.0}, skipped=False, **common) is None
    logger.record(2, losses={"lm loss": float("nan")}, skipped=True, **common)
    line = logger.record(3, losses={"lm loss": 4.0}, skipped=False, **{**common, "consumed_samples": 12})
    assert printed == [line]
    parsed = parse_train_line(line)
    assert parsed["losses"] == {"lm loss": 3.0} and parsed["skipped"] == 1 and parsed["nan"] == 1
    assert FACTS_LINE.match(line)
    assert "peak memory per device (GiB):" in parsed["extra"]
    quiet = TrainLogger(train_iters=10, log_interval=1, global_batch_size=4, world_size=2, device=torch.device("cpu"),
                        is_logging_rank=False, tokens_per_iteration=64, print_fn=printed.append)
    quiet.record(1, losses={"lm loss": 1.0}, skipped=False, **common)
    assert len(printed) == 1  # only the logging rank prints


def test_tensorboard_notice_or_scalars(tmp_path):
    printed = []
    logger = TrainLogger(train_iters=2, log_interval=1, global_batch_size=1, world_size=1, device=torch.device("cpu"),
                         is_logging_rank=True, tokens_per_iteration=8, tensorboard_dir=str(tmp_path / "tb"),
                         print_fn=printed.append)
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        assert logger.writer is None and printed[0].startswith("notice: tensorboard is not installed")
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger.record(1, losses={"lm loss": 1.5}, skipped=False, learning_rate=1e-3, grad_norm=1.0, consumed_samples=1)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"lm loss", "learning-rate", "grad-norm", "batch-size"} <= set(events.Tags()["scalars"])
    assert events.Scalars("lm loss")[0].value == 1.5


def _fake_clock(monkeypatch, times):
    """The logger's clock returns `times` in turn (its constructor and each logged record read it once)."""
    import types

    import fsdp2_backend.training.logging as logging_module

    ticks = iter(times)
    monkeypatch.setattr(logging_module, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))


def test_throughput_field_from_flops_per_iteration(monkeypatch):
    # Megatron: throughput = flops of one iteration / (time per iteration * 1e12 * world size).
    _fake_clock(monkeypatch, [100.0, 104.0])  # two iterations in 4 s: 2 s per iteration
    logger = TrainLogger(train_iters=10, log_interval=2, global_batch_size=4, world_size=2,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=64,
                         print_fn=lambda line: None, flops_per_iteration=4e13, peak_flops_per_device=20e12)
    common = dict(learning_rate=1e-3, grad_norm=0.5, consumed_samples=8)
    logger.record(1, losses={"lm loss": 2.0}, skipped=False, **common)
    line = logger.record(2, losses={"lm loss": 2.0}, skipped=False, **common)
    # 4e13 / 2 s / 2 devices = 10 TFLOP/s per device; against a 20 TFLOP/s peak, 50 % MFU
    assert " elapsed time per iteration (ms): 2000.0 | throughput per GPU (TFLOP/s/GPU): 10.0 |" \
           " learning rate: 1.000000E-03 |" in line
    assert line.endswith(" tokens per second per device: 16.0 | peak memory per device (GiB): "
                         f"{parse_train_line(line)['peak_memory_gib']:.2f} | model flops utilization (%): 50.00 |")
    parsed = parse_train_line(line)
    assert parsed["tflops"] == 10.0 and parsed["mfu_percent"] == 50.0 and parsed["elapsed_ms"] == 2000.0
    assert parsed["tokens_per_sec_per_device"] == 16.0 and parsed["cpu_memory_gib"] is None
    assert parsed["losses"] == {"lm loss": 2.0} and parsed["grad_norm"] == 0.5


def test_throughput_without_a_known_peak_has_no_mfu():
    logger = TrainLogger(train_iters=10, log_interval=1, global_batch_size=4, world_size=1,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=64,
                         print_fn=lambda line: None, flops_per_iteration=1e9)
    assert logger.peak_flops_per_device is None  # CPU: no peak
    line = logger.record(1, losses={"lm loss": 1.0}, skipped=False, learning_rate=1e-3, grad_norm=0.5,
                         consumed_samples=4)
    parsed = parse_train_line(line)
    assert parsed["tflops"] is not None and parsed["mfu_percent"] is None
    assert "model flops utilization" not in line and "cpu memory" not in line


def test_options_off_keep_the_line_unchanged():
    logger = TrainLogger(train_iters=10, log_interval=1, global_batch_size=4, world_size=1,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=64,
                         print_fn=lambda line: None)
    line = logger.record(1, losses={"lm loss": 1.0}, skipped=False, learning_rate=1e-3, grad_norm=0.5,
                         consumed_samples=4)
    m = FACTS_LINE.match(line)
    assert m and "throughput" not in line and "cpu memory" not in line and "utilization" not in line
    assert re.fullmatch(r" tokens per second per device: \d+\.\d \| peak memory per device \(GiB\): \d+\.\d\d \|",
                        line[m.end():])
    parsed = parse_train_line(line)
    assert parsed["tflops"] is None and parsed["mfu_percent"] is None and parsed["cpu_memory_gib"] is None


def test_cpu_memory_field_only_with_the_option():
    line = _line(cpu_memory_gib=1.254, cpu_memory_peak_gib=2.5)
    assert line.endswith(" peak memory per device (GiB): 1.50 | cpu memory (GiB): current 1.25, peak 2.50 |")
    parsed = parse_train_line(line)
    assert (parsed["cpu_memory_gib"], parsed["cpu_memory_peak_gib"]) == (1.25, 2.5)
    assert (parsed["tokens_per_sec_per_device"], parsed["peak_memory_gib"]) == (4096.2, 1.5)
    assert "cpu memory" not in _line()

    import resource

    logger = TrainLogger(train_iters=10, log_interval=1, global_batch_size=4, world_size=1,
                         device=torch.device("cpu"), is_logging_rank=True, tokens_per_iteration=64,
                         print_fn=lambda line: None, log_cpu_memory=True)
    line = logger.record(1, losses={"lm loss": 1.0}, skipped=False, learning_rate=1e-3, grad_norm=0.5,
                         consumed_samples=4)
    parsed = parse_train_line(line)
    assert FACTS_LINE.match(line) and "throughput" not in line
    # this process: a python + torch process holds tens of MiB at least; the peak is getrusage's (KiB on Linux)
    assert 0.01 < parsed["cpu_memory_gib"] <= parsed["cpu_memory_peak_gib"]
    peak_now = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert abs(parsed["cpu_memory_peak_gib"] - peak_now) < 0.05
