"""benchmarks/gpu_check.sh --dry: the accelerator check's every step on CPU at tiny shapes (the real run needs a
GPU)."""
import os
import re
import subprocess
import sys

from tests.support.launchers import REPO


def test_gpu_check_dry_mode_prints_both_sides():
    env = {**os.environ, "PYTHON": sys.executable}  # the tests' environment, activated or not
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for kernel in ("rmsnorm", "rmsnorm_gated", "gated_delta_rule", "causal_conv1d"):  # under the interpreter
        assert f"kernel {kernel} float32: triton on the triton interpreter (cpu) matches" in proc.stdout
    figures = re.findall(r"^(engine \(pretrain_fsdp2.py\)|engine, compiled blocks|bare fully_shard loop)\s+tokens/s\s+([\d.]+)\s+TFLOP/s\s+"
                         r"([\d.]+)\s+MFU % (n/a)$", proc.stdout, re.M)
    assert [name for name, *_ in figures] == ["engine (pretrain_fsdp2.py)", "engine, compiled blocks",
                                              "bare fully_shard loop"]
    assert all(float(tokens) > 0 for _, tokens, _, _ in figures)  # CPU: no known peak, so no MFU
    assert re.search(r"^engine / bare tokens/s: \d+\.\d\d$", proc.stdout, re.M)
    assert re.search(r"^compiled / eager tokens/s: \d+\.\d\d; compiled / bare tokens/s: \d+\.\d\d$", proc.stdout, re.M)
    offload = re.search(r"^offload: device peak memory GiB ([\d.]+) without, ([\d.]+) with --optimizer-cpu-offload "
                        r"--cpu-offloading-num-layers 2 \(tokens/s ([\d.]+) vs ([\d.]+)\)$", proc.stdout, re.M)
    assert offload and all(float(v) > 0 for v in offload.groups())  # CPU: the figures, not a saving
