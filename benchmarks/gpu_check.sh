#!/usr/bin/env bash
# The accelerator check (one CUDA GPU, after `make install`, under 8 minutes): the triton kernels for real and
# the engine's tokens/s, TFLOP/s and MFU beside a bare fully_shard loop. `--dry` (or GPU_CHECK_DRY=1): on CPU,
# tiny shapes, for CI. Everything is in benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec env HF_HUB_OFFLINE=1 timeout 470 python benchmarks/gpu_check.py "$@"
