"""The triton depthwise causal conv1d (`kernels.causal_conv1d_triton`) on CPU tensors under the triton interpreter,
in a fresh process, against the torch reference `kernels.causal_conv1d.causal_conv1d_reference` (itself checked
against a per-token oracle and transformers' `causal_conv1d_fn` in tests/kernels/test_gated_delta_rule.py): outputs and
the gradients of x, weight and bias — lengths and channel counts not a multiple of the blocks, several T blocks per
backward program, packed documents (one of length 1, a row boundary inside the packing, one running on from one
row into the next), with and without SiLU, kernel widths 4 and 3, fp32 and bf16; and which implementation
Qwen3-Next's mixer selects on each device.
Shapes are tiny: the interpreter runs every program in Python.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fsdp2_backend.kernels.causal_conv1d import conv1d_implementation

REPO = Path(__file__).resolve().parents[2]

CHECK = r"""
import torch
from fsdp2_backend.kernels.causal_conv1d import causal_conv1d_reference as reference
from fsdp2_backend.kernels.causal_conv1d_triton import triton_causal_conv1d as conv

def case(batch, length, channels, width, dtype, bias, activation, cu, blocks, seed, tol):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, channels, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(channels, width, generator=gen) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(channels, generator=gen).to(dtype).requires_grad_() if bias else None
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    out = conv(x, w, b, activation, cu, **blocks)
    want = reference(x, w, b, activation, cu)
    assert out.dtype == x.dtype and out.shape == want.shape
    what = f"{batch}x{length}x{channels} w{width} {dtype} bias={bias} {activation} cu={cu}"
    torch.testing.assert_close(out.double(), want.double(), atol=tol, rtol=tol, msg=what)
    dy = torch.randn(out.shape, generator=gen).to(dtype)
    leaves = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(out, leaves, dy)
    exp = torch.autograd.grad(want, leaves, dy)
    for name, a, e in zip("x weight bias".split(), got, exp):
        assert a.dtype == e.dtype, name
        # weight / bias gradients sum over all tokens: scale the tolerance by the largest term
        scale = 1.0 if name == "x" else max(1.0, float(e.double().abs().max()))
        torch.testing.assert_close(a.double(), e.double(), atol=tol * scale, rtol=tol, msg=f"grad of {name}: {what}")

small = dict(block_t=4, block_c=8)  # 13 tokens = 4 T blocks (the last one partial), 10 channels = 2 C blocks
# unpacked rows, bias, SiLU (several T blocks per backward program)
case(2, 13, 10, 4, torch.float32, True, "silu", None, small, 0, 1e-5)
# packed: documents 2, 7 | 1, 8 over two rows of 9 (a document of one token; a row start is a document start)
case(2, 9, 10, 4, torch.float32, False, "silu", [0, 2, 9, 10, 18], small, 1, 1e-5)
# a document running on from one row into the next (cu_seqlens over the flattened tokens): the reference's taps
# stop at the row start
case(2, 9, 6, 4, torch.float32, True, "silu", [0, 3, 12, 18], small, 5, 1e-5)
# no activation, width 3, packed with bias
case(1, 11, 5, 3, torch.float32, True, None, [0, 4, 5, 11], small, 2, 1e-5)
# the default blocks (one partial block)
case(2, 13, 10, 4, torch.float32, True, "silu", [0, 6, 13, 20, 26], {}, 3, 1e-5)
# bf16 in and out: fp32 inside with one rounding, where the reference rounds after the conv and after the SiLU
case(2, 9, 10, 4, torch.bfloat16, True, "silu", [0, 2, 9, 10, 18], small, 4, 3e-2)
print("ok")
"""


def test_triton_causal_conv1d_matches_the_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_conv_runs_triton_where_the_gated_delta_rule_does():
    assert conv1d_implementation("cuda", "triton") == "triton"  # use_triton_gdn on CUDA
    assert conv1d_implementation("cuda", "torch") == "torch"
    assert conv1d_implementation("cpu", "triton") == "torch"  # never the interpreter in a run
    assert conv1d_implementation("npu", "npu") == "torch"  # use_flash_gdn: the reference's tensor ops
