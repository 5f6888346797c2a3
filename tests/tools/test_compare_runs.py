"""tools/compare_runs.py on real Megatron-LM log lines and golden values (tests/data/megatron_logs, see its README)
and on this project's own runs: a resumed run against a straight one (agree), a different learning rate
(diverge), a TensorBoard directory against the log of the same run; the plot file holds both curves."""
import json
import subprocess
import sys

import pytest

from tests.support.launchers import REPO, run_pretrain
from tests.support.megatron_lines import RESUME_RUN_FLAGS
from fsdp2_backend.cli.compare_runs import compare, main, parse_log_line, read_run, DEFAULT_RTOL

DATA = f"{REPO}/tests/data/megatron_logs"
BLUE, ORANGE = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)


def _pixels(png, rgb):
    """How many pixels of the image are (nearly) the colour `rgb`."""
    import matplotlib.image
    import numpy as np

    image = (matplotlib.image.imread(png)[..., :3] * 255).astype(int)
    return int((np.abs(image - np.array(rgb)).sum(axis=-1) < 40).sum())


def test_reads_megatron_lm_lines_of_both_vintages():
    iteration, fields = parse_log_line(open(f"{DATA}/megatron_lm_issue756_mixtral.log").readline())
    assert iteration == 71 and fields["consumed samples"] == 9088 and fields["load_balancing_loss"] == 1.013377
    run = read_run(f"{DATA}/megatron_lm_issue756_mixtral.log")
    assert run.series["lm loss"] == {71: 1.818812, 72: 1.820313, 73: 1.798953}
    assert run.series["throughput (TFLOP/s/GPU)"][72] == 238.7 and run.series["grad norm"][73] == 1.539
    assert run.series["learning rate"][71] == 1.42e-05 and run.samples == {71: 9088, 72: 9216, 73: 9344}
    old = read_run(f"{DATA}/megatron_llm_issue11_old_format.log")  # no timestamp, lr with 3 decimals
    assert old.series["learning rate"][122] == 9.15e-06 and old.series["lm loss"][125] == 2.477393
    assert old.series["skipped iterations"][124] == 0 and old.samples[125] == 128000


def test_golden_values_agree_with_themselves_and_a_shifted_copy_diverges(tmp_path, capsys):
    golden = f"{DATA}/golden_values_gpt3_tp1_pp1_dgx_h100.json"
    data = json.load(open(golden))
    assert main([golden, golden]) == 0
    assert "verdict: AGREE" in capsys.readouterr().out
    # a run whose loss drifts up by 5 % from step 30 on
    data["lm loss"]["values"] = {k: v * (1.05 if int(k) >= 30 else 1.0) for k, v in data["lm loss"]["values"].items()}
    (tmp_path / "drift.json").write_text(json.dumps(data))
    assert main([golden, str(tmp_path / "drift.json"), "--plot", str(tmp_path / "drift.png")]) == 1
    out = capsys.readouterr().out
    assert "verdict: DIVERGE — lm loss from iteration 30" in out
    assert _pixels(tmp_path / "drift.png", BLUE) > 200 and _pixels(tmp_path / "drift.png", ORANGE) > 200
    assert main([golden, str(tmp_path / "drift.json"), "--loss-rtol", "0.06"]) == 0  # inside a looser tolerance


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
    (tmp_path / "empty.log").write_text("nothing here\n")
    result = subprocess.run([sys.executable, "tools/compare_runs.py", str(tmp_path / "empty.log"),
                             str(tmp_path / "missing.log")], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and result.stderr.count("error:") == 1 and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Our runs: straight (with TensorBoard), stopped at 6 and resumed, and one with a 3x learning rate."""
    root = tmp_path_factory.mktemp("runs")
    logs = {}
    extra = ("--log-throughput",)
    _, logs["straight"] = run_pretrain(RESUME_RUN_FLAGS, root / "straight", *extra, "--tensorboard-dir", str(root / "tb"))
    _, first = run_pretrain(RESUME_RUN_FLAGS, root / "resumed", *extra, "--exit-interval", "6")
    _, second = run_pretrain(RESUME_RUN_FLAGS, root / "resumed", *extra, "--exit-interval", "6")
    logs["resumed"] = first + second
    _, logs["lr"] = run_pretrain([*RESUME_RUN_FLAGS, "--lr", "3e-3"], root / "lr", *extra)
    for name, log in logs.items():
        (root / f"{name}.log").write_text(log)
    return root


def test_resumed_run_agrees_with_the_straight_run_and_the_plot_has_both(runs, capsys):
    plot = runs / "resumed_vs_straight.png"
    assert main([str(runs / "straight.log"), str(runs / "resumed.log"), "--plot", str(plot),
                 "--labels", "straight", "resumed"]) == 0
    out = capsys.readouterr().out
    assert "aligned by iteration: 12 points (1..12)" in out and "verdict: AGREE" in out
    _, _, reports = compare(read_run(str(runs / "straight.log")), read_run(str(runs / "resumed.log")), DEFAULT_RTOL)
    loss = next(r for r in reports if r.metric == "lm loss")
    assert loss.points == 12 and loss.max_rel < 1e-4  # (bit-exact resume is test_resume_e2e's to prove)
    assert {"throughput (TFLOP/s/GPU)", "learning rate", "grad norm"} <= {r.metric for r in reports}
    assert _pixels(plot, BLUE) > 200 and _pixels(plot, ORANGE) > 200


def test_a_different_learning_rate_diverges(runs, capsys):
    plot = runs / "lr.png"
    assert main([str(runs / "straight.log"), str(runs / "lr.log"), "--plot", str(plot)]) == 1
    out = capsys.readouterr().out
    assert "verdict: DIVERGE" in out and "learning rate from iteration 1" in out
    assert _pixels(plot, BLUE) > 200 and _pixels(plot, ORANGE) > 200


def test_tensorboard_directory_against_the_log_of_the_same_run(runs, capsys):
    assert main([str(runs / "tb"), str(runs / "straight.log")]) == 0
    out = capsys.readouterr().out
    assert "aligned by iteration: 12 points" in out and "verdict: AGREE" in out
    tb = read_run(str(runs / "tb"))
    assert tb.samples == {it: 4 * it for it in range(1, 13)}
