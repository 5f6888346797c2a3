"""The triton Mamba-3 scan (`kernels.mamba3_scan_triton`, forward kernel + torch backward) on CPU tensors under the
triton interpreter, in a fresh process: values against the sequential oracle (SISO, MIMO, chunk sizes, lengths
not a multiple of the chunk, packed documents), gradients against the torch chunked scan; and the dispatch.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fsdp2_backend.kernels.mamba3_scan import mamba3_scan_implementation

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from tests.support.kernel_references import mamba3_inputs as _inputs, sequential_oracle
from fsdp2_backend.kernels.mamba3_scan import mamba3_chunk_scan
from fsdp2_backend.kernels.mamba3_scan_triton import triton_mamba3_chunk_scan

for b, l, r, h, n, p, a, cs in [(2, 13, 1, 3, 8, 4, 2, 4), (1, 20, 2, 2, 16, 8, 4, 8), (2, 9, 3, 1, 8, 4, 2, 5),
                                (1, 7, 1, 2, 8, 4, 1, 16)]:
    inputs = _inputs(b, l, r, h, n, p, a, seed=l)
    for doc_start in (None, torch.zeros(b, l, dtype=torch.bool)):
        if doc_start is not None:
            doc_start[:, [l // 3, l // 2]] = True
            doc_start[-1, l - 1] = True
        got = triton_mamba3_chunk_scan(*inputs, chunk_size=cs, doc_start=doc_start)
        torch.testing.assert_close(got.double(), sequential_oracle(*inputs, doc_start=doc_start),
                                   rtol=1e-4, atol=1e-5)
        ref = mamba3_chunk_scan(*inputs, chunk_size=cs, doc_start=doc_start)
        dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(l))
        for x, y in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(ref, inputs, dy)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_triton_scan_matches_the_oracle_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_dispatch_by_device():
    assert mamba3_scan_implementation("cpu") == "torch" and mamba3_scan_implementation("npu") == "torch"
    assert mamba3_scan_implementation("cuda") == "triton"
