#!/usr/bin/env bash
# The accelerator check (one CUDA GPU, after `make install`, under 8 minutes): the triton kernels for real and
# the engine's tokens/s, TFLOP/s and MFU, eager and with compiled decoder blocks (--optimization.torch_compile),
# beside a bare fully_shard loop. `--dry` (or GPU_CHECK_DRY=1): on CPU,
# tiny shapes, for CI. Everything is in benchmarks/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY=0
for arg in "$@"; do [[ "$arg" == "--dry" ]] && DRY=1; done
[[ "${GPU_CHECK_DRY:-0}" == "1" ]] && DRY=1
# dry: the kernels run under the triton interpreter on CPU; the real run must not (it checks the compiled kernels)
if [[ $DRY == 1 ]]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
# PYTHON: the environment to run in (`make install` put the project there); plain `python` otherwise
exec env HF_HUB_OFFLINE=1 timeout 470 "${PYTHON:-python}" benchmarks/gpu_check.py "$@"
