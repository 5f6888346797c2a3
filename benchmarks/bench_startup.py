"""Start-up: seconds from the command to the first iteration's log line of a 1-rank tiny run, next to the floor
(`python -c "import torch, transformers"`), measured in the same run.

The run: `pretrain_fsdp2.py` with Megatron flags, a 2-layer Qwen3-style model of hidden 64, mock data with the
NullTokenizer, one iteration, no save. Rounds alternate the two commands (this machine is shared: both see the
same load); per command the median of the wall seconds to the first iteration line (the import floor: to its
exit) and of the CPU seconds of the whole process.

    python -m benchmarks.bench_startup [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer "
         "--vocab-size 255 --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights "
         "--disable-bias-linear --position-embedding-type rope --normalization RMSNorm --swiglu --mock-data "
         "--train-iters 1 --lr 1e-4 --log-interval 1 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0").split()
COMMANDS = {
    "import torch, transformers": [sys.executable, "-c", "import torch, transformers"],
    "tiny run, first iteration line": [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *FLAGS],
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measure(command) -> tuple:
    """(wall seconds to the first iteration line, or to the exit when it prints none; CPU seconds of the process)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    cpu, start = _children_cpu(), time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO, env=env)
    first = None
    for line in proc.stdout:
        if first is None and " iteration " in line and "consumed samples" in line:
            first = time.perf_counter() - start
    if proc.wait():
        raise SystemExit(f"failed: {' '.join(command)}")
    return first if first is not None else time.perf_counter() - start, _children_cpu() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    results = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            results[name].append(_measure(command))
    print(f"1-rank start-up, median of {args.rounds} alternating rounds: wall seconds [CPU seconds]")
    floor = None
    for name, runs in results.items():
        wall, cpu = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        floor = floor or (wall, cpu)
        print(f"  {name:32s}: {wall:6.2f} s [{cpu:6.2f} s]  ({wall / floor[0]:.2f}x [{cpu / floor[1]:.2f}x] the imports)")


if __name__ == "__main__":
    main()
