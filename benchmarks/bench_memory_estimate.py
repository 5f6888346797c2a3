#!/usr/bin/env python
"""The memory estimate (fsdp2_backend/config/memory_estimate.py) beside the measured peak of the same run.

    python benchmarks/bench_memory_estimate.py [--iters 2]

Three configurations of a Megatron command line (a 4-layer model from flags, mock data, one CPU rank): fp32,
bf16 with a larger micro-batch, and that again with --recompute-activations. Each runs in a process of its own:
it makes the estimate as pretrain_fsdp2.py does, notes its resident memory (torch, transformers and the engine
imported, nothing built), trains `--iters` iterations, and reports the peak resident memory above that baseline
(ru_maxrss) beside the estimate; then the parameter bytes of the built model beside the config-derived count.
Measured (2 busy cores, torch 2.13 CPU): peak / estimate 1.21, 1.34, 1.48; parameters 81.02 vs 81.27 MiB (the
estimate leaves out norms' and biases' few weights and lazily imported modules, numba's compiled index kernels
among them, count in the peak).
The estimate leaves out the runtime (allocator caches, the interpreter's growth): a measured peak above it is
expected; one far below it would make a refusal wrong. Figures vary with the machine's load and allocator.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ("--num-layers 4 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --seq-length 512 "
         "--max-position-embeddings 512 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 16384 "
         "--swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type rope --log-interval 1 "
         "--eval-iters 0 --hidden-dropout 0 --attention-dropout 0").split()
CONFIGS = {
    "fp32, micro-batch 2": ["--micro-batch-size", "2", "--global-batch-size", "2"],
    "bf16, micro-batch 4": ["--bf16", "--micro-batch-size", "4", "--global-batch-size", "4"],
    "bf16, micro-batch 4, recompute": ["--bf16", "--micro-batch-size", "4", "--global-batch-size", "4",
                                       "--recompute-activations"],
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(argv) -> dict:
    """In the child: the estimate, then the run's peak above the baseline."""
    import contextlib
    import io

    import torch

    from fsdp2_backend.build import build, run_training
    from fsdp2_backend.config.memory_estimate import estimate_memory
    from fsdp2_backend.launch import parse_command_line

    config, _ = parse_command_line(argv, 1, check_files=True)
    estimate = estimate_memory(config, 1)
    # the runtime's own imports before the baseline (the estimate leaves them out)
    import fsdp2_backend.models.loading  # noqa: F401
    import fsdp2_backend.parallel.apply  # noqa: F401
    import fsdp2_backend.training.trainer  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    baseline = _rss()
    with contextlib.redirect_stdout(io.StringIO()):
        run_training(config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    with contextlib.redirect_stdout(io.StringIO()):
        job = build(config)  # the built model's parameter count, against the config-derived one
        built = sum(p.numel() for p in job.model.parameters()) * 4 // config.parallel.tp_size
        job.close()
    del torch
    return {"estimate": estimate.total, "measured": peak, "line": estimate.line(),
            "parameter_bytes": estimate.parameters, "built_parameter_bytes": built}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    mib = lambda n: n / (1 << 20)  # noqa: E731
    print(f"{'configuration':34s} {'estimate MiB':>13s} {'measured peak MiB':>18s} {'measured/estimate':>18s}")
    for name, extra in CONFIGS.items():
        argv = SHAPE + ["--train-iters", str(args.iters)] + extra
        out = subprocess.run([sys.executable, __file__, "--one", json.dumps(argv)], capture_output=True, text=True,
                             env=env, cwd=REPO, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:34s} {mib(row['estimate']):13.1f} {mib(row['measured']):18.1f} "
              f"{row['measured'] / row['estimate']:18.2f}")
        print(f"    {row['line']}")
        print(f"    parameters: estimate {mib(row['parameter_bytes']):.2f} MiB, built model "
              f"{mib(row['built_parameter_bytes']):.2f} MiB (fp32)")


if __name__ == "__main__":
    sys.path.insert(0, REPO)
    main()
