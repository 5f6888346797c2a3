"""Gated RMSNorm (`kernels.rmsnorm_gated`): the torch reference against transformers' own gated norms
(Qwen3-Next's `Qwen3NextRMSNormGated`: norm before gate; Mamba-2's `MambaRMSNormGated`: gate before a grouped
norm), the grouped norm against per-group plain norms, and the triton kernel against the reference (values and
gradients, every variant) on CPU under the triton interpreter in a fresh process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp2_backend.kernels.rmsnorm import rms_norm_reference
from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated, rms_norm_gated_implementation, rms_norm_gated_reference

REPO = Path(__file__).resolve().parents[2]


def _grads(out, inputs, seed=3):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_before_gate_equals_qwen3_next(dtype):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    torch.manual_seed(0)
    module = Qwen3NextRMSNormGated(48, eps=1e-6).to(dtype)
    torch.nn.init.normal_(module.weight, 1.0, 0.2)
    x = torch.randn(2, 5, 48, dtype=dtype, requires_grad=True)
    gate = torch.randn(2, 5, 48, dtype=dtype, requires_grad=True)
    expected = module(x, gate)
    got = rms_norm_gated_reference(x, gate, module.weight, 1e-6, norm_before_gate=True)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    inputs = (x, gate, module.weight)
    assert all(torch.equal(a, b) for a, b in zip(_grads(got, inputs), _grads(expected, inputs)))


@pytest.mark.parametrize("group_size", [16, 48])
def test_gate_before_grouped_norm_equals_mamba2(group_size):
    from transformers.models.mamba2 import modeling_mamba2

    # transformers 5.25 renamed it (MambaRMSNormGated → Mamba2RMSNormGated); the math is the same
    gated_norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    torch.manual_seed(1)
    module = gated_norm(48, group_size=group_size, eps=1e-5)
    torch.nn.init.normal_(module.weight, 1.0, 0.2)
    x = torch.randn(3, 4, 48, requires_grad=True)
    gate = torch.randn(3, 4, 48, requires_grad=True)
    expected = module(x, gate)
    got = rms_norm_gated_reference(x, gate, module.weight, 1e-5, group_size=group_size, norm_before_gate=False)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    inputs = (x, gate, module.weight)
    for a, b in zip(_grads(got, inputs), _grads(expected, inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_is_a_plain_rmsnorm_per_group_and_zero_centered_adds_one():
    torch.manual_seed(2)
    x, gate, w = torch.randn(4, 6, 32), torch.randn(4, 6, 32), torch.randn(32)
    got = rms_norm_gated_reference(x, gate, w, 1e-6, group_size=8, zero_centered=True)
    parts = [rms_norm_reference(x[..., i:i + 8], 1.0 + w[i:i + 8], 1e-6) * torch.nn.functional.silu(gate[..., i:i + 8])
             for i in range(0, 32, 8)]
    torch.testing.assert_close(got, torch.cat(parts, -1), rtol=1e-6, atol=1e-6)
    # no gate: the plain RMSNorm
    torch.testing.assert_close(rms_norm_gated_reference(x, None, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_bad_group_size_and_weight_are_refused():
    x, w = torch.randn(2, 12), torch.ones(12)
    with pytest.raises(ValueError, match="group_size 5"):
        rms_norm_gated_reference(x, None, w, 1e-6, group_size=5)
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm_gated(x, None, torch.ones(6), 1e-6)


def test_dispatch_by_device():
    assert rms_norm_gated_implementation("cpu") == "torch" and rms_norm_gated_implementation("npu") == "torch"
    assert rms_norm_gated_implementation("cuda") == "triton"
    x, g, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    assert torch.equal(rms_norm_gated(x, g, w, 1e-6, group_size=4),
                       rms_norm_gated_reference(x, g, w, 1e-6, group_size=4))


TRITON_CHECK = r"""
import itertools, torch
from fsdp2_backend.kernels.rmsnorm_gated import rms_norm_gated_reference
from fsdp2_backend.kernels.rmsnorm_gated_triton import triton_rms_norm_gated

torch.manual_seed(0)
# rows > the backward's 4 programs exercise its row loop; 48 / 100 / 12 are not powers of two (masking)
cases = [((2, 7, 48), None), ((2, 7, 48), 12), ((37, 100), None), ((9, 64), 16), ((0, 16), None)]
for (shape, group), nbg, zc, has_gate, dtype in itertools.product(
        cases, (True, False), (False, True), (True, False), (torch.float32, torch.bfloat16)):
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype, requires_grad=True) if has_gate else None
    w = (0.1 * torch.randn(shape[-1]) + (0.0 if zc else 1.0)).to(dtype).requires_grad_()
    kw = dict(group_size=group, norm_before_gate=nbg, zero_centered=zc)
    got, ref = triton_rms_norm_gated(x, g, w, 1e-6, **kw), rms_norm_gated_reference(x, g, w, 1e-6, **kw)
    assert got.dtype == ref.dtype == dtype and got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    inputs = [t for t in (x, g, w) if t is not None]
    dy = torch.randn_like(ref)
    for a, b, name in zip(torch.autograd.grad(got, inputs, dy), torch.autograd.grad(ref, inputs, dy), "xgw"):
        scale = max(1.0, b.float().abs().amax().item()) if b.numel() else 1.0
        torch.testing.assert_close(a.float(), b.float(), rtol=4 * tol, atol=4 * tol * scale,
                                   msg=f"d{name} {shape} group={group} nbg={nbg} zc={zc} gate={has_gate} {dtype}")
print("ok")
"""


def test_triton_kernel_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
