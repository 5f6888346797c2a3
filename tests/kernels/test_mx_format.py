"""MXFP8 quantise / dequantise (kernels.mx, torchao underneath) and the MXFP8 linear (kernels.mx_linear) against an
independent plain-torch implementation of the OCP Microscaling v1.0 spec written here.

The reference follows the spec's text, not torchao's code: per block of 32 along the last dim, the shared E8M0
scale is X = 2^(floor(log2(amax)) - 8) (8 = E4M3's largest exponent), clamped to E8M0's range [-127, 127];
elements are v / X rounded to nearest even on the E4M3 grid (3 mantissa bits, subnormals below 2^-6) and
saturated to ±448. It works in float64 on the exponent and mantissa directly (no float8 casts).
"""
import pytest
import torch

from fsdp2_backend.kernels.mx import mx_dequantize, mx_fake_quantize, mx_quantize
from fsdp2_backend.kernels.mx_linear import mx_grouped_linear, mx_linear

E4M3_MAX, E4M3_EMAX, E4M3_MIN_EXP, E4M3_MBITS = 448.0, 8, -6, 3


def spec_quantize(x: torch.Tensor):
    """(element values as float64, unbiased scale exponents) per the OCP MX spec, blocks of 32 on the last dim."""
    blocks = x.double().reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.full_like(amax, -1000.0))
    scale_exp = (exponent - E4M3_EMAX).clamp(-127, 127)
    v = blocks / torch.exp2(scale_exp)
    # Round to nearest even on the E4M3 grid: the spacing is 2^(e - 3) for |v| in [2^e, 2^(e+1)), with e >= -6.
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** E4M3_MIN_EXP))).clamp_min(E4M3_MIN_EXP)
    quantum = torch.exp2(e - E4M3_MBITS)
    rounded = torch.round(v / quantum) * quantum  # torch.round: half to even
    elements = rounded.clamp(-E4M3_MAX, E4M3_MAX)  # saturation
    return elements.reshape(x.shape), scale_exp.reshape(*x.shape[:-1], x.shape[-1] // 32)


def spec_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    elements, scale_exp = spec_quantize(x)
    return (elements.reshape(-1, 32) * torch.exp2(scale_exp.reshape(-1, 1))).reshape(x.shape)


def _hard_cases() -> torch.Tensor:
    """Blocks over a wide range of magnitudes, plus blocks that exercise saturation, ties, zeros, subnormals."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(40, 32, generator=g) * torch.exp2(torch.randint(-30, 30, (40, 1), generator=g).float())
    saturate = torch.randn(1, 32, generator=g)
    saturate[0, 0] = 511.0  # floor(log2 511) = 8 → X = 1 → 511 saturates to 448; 460 and 470 as well
    saturate[0, 1], saturate[0, 2] = 460.0, -470.0
    ties = torch.full((1, 32), 0.5)
    ties[0, :6] = torch.tensor([256.0, 1.0625, 1.1875, -1.0625, 3.125, 17.0])  # halfway points → even mantissa
    zeros = torch.zeros(1, 32)
    tiny = torch.full((1, 32), 1.0)
    tiny[0, 1:] = torch.linspace(-2.0 ** -9, 2.0 ** -9, 31)  # subnormal E4M3 elements after scaling (X = 2^-8)
    return torch.cat([wide, saturate, ties, zeros, tiny])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_ocp_spec_reference(dtype):
    x = _hard_cases().to(dtype)
    q, scale = mx_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    assert scale.shape == (x.shape[0], 1)
    elements, scale_exp = spec_quantize(x)
    assert torch.equal(scale.view(torch.uint8).long(), (scale_exp + 127).long())  # E8M0: biased exponent
    assert torch.equal(q.double(), elements)
    assert q.double().abs().max() == E4M3_MAX  # saturation happened
    assert torch.equal(q[-4:-3].double(), elements[-4:-3])  # the ties row
    assert torch.equal(mx_dequantize(q, scale, torch.float64), spec_fake_quantize(x))


def test_quantize_blocks_run_along_the_last_dim():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 4 * 32, generator=g) * torch.exp2(torch.arange(4).repeat_interleave(32).float() * 5)
    q, scale = mx_quantize(x)
    assert scale.shape == (6, 4)
    assert torch.equal(mx_fake_quantize(x).double(), spec_fake_quantize(x))
    assert not torch.equal(mx_fake_quantize(x), x)  # it really quantises


def _reference_linear(x, w):
    """The MXFP8 recipe's three GEMMs with the spec reference: y, and the function giving (dx, dw) for dy."""
    y = spec_fake_quantize(x.reshape(-1, x.shape[-1])) @ spec_fake_quantize(w).t()

    def grads(dy):
        dy2 = dy.reshape(-1, dy.shape[-1]).double()
        dx = spec_fake_quantize(dy2) @ spec_fake_quantize(w.t().contiguous()).t()
        pad = -dy2.shape[0] % 32  # the token dim is zero-padded to whole blocks
        dyt = torch.nn.functional.pad(dy2.t(), (0, pad))
        xt = torch.nn.functional.pad(x.reshape(-1, x.shape[-1]).double().t(), (0, pad))
        dw = spec_fake_quantize(dyt) @ spec_fake_quantize(xt).t()
        return dx.reshape(x.shape), dw
    return y.reshape(*x.shape[:-1], -1), grads


def test_mx_linear_forward_and_gradients_match_the_emulated_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 20, 64, generator=g, requires_grad=True)  # 60 tokens: the weight-grad GEMM pads to 64
    w = (torch.randn(96, 64, generator=g) * 0.05).requires_grad_(True)
    dy = torch.randn(3, 20, 96, generator=g)
    y = mx_linear(x, w)
    y.backward(dy)
    ref_y, grads = _reference_linear(x.detach(), w.detach())
    ref_dx, ref_dw = grads(dy)
    # The GEMMs of dequantised values agree up to fp32 accumulation order.
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-5, atol=1e-5)
    # And it is not the high-precision linear.
    assert (y - x.detach() @ w.detach().t()).abs().max() > 1e-3


def test_mx_linear_matches_torchao_emulated_mxfp8_linear():
    """torchao's own MXFP8 training linear (emulated, FLOOR scales) computes the same three GEMMs."""
    from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.quantization.quantize_.common import KernelPreference

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g, requires_grad=True)
    w = torch.randn(32, 64, generator=g, requires_grad=True)
    dy = torch.randn(64, 32, generator=g)
    mx_linear(x, w).backward(dy)
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    _to_mxfp8_then_scaled_mm(x2, w2, KernelPreference.EMULATED, ScaleCalculationMode.FLOOR).backward(dy)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)


def test_mx_grouped_linear_is_the_per_expert_mx_linear():
    g = torch.Generator().manual_seed(4)
    counts = torch.tensor([5, 0, 40, 19])
    x = torch.randn(int(counts.sum()), 64, generator=g, requires_grad=True)
    w = torch.randn(4, 32, 64, generator=g, requires_grad=True)
    dy = torch.randn(int(counts.sum()), 32, generator=g)
    mx_grouped_linear(x, w, counts).backward(dy)
    for e, (rows, d) in enumerate(zip(x.detach().split(counts.tolist()), dy.split(counts.tolist()))):
        if not rows.shape[0]:
            assert torch.count_nonzero(w.grad[e]) == 0
            continue
        ref_y, grads = _reference_linear(rows, w.detach()[e])
        ref_dx, ref_dw = grads(d)
        start = int(counts[:e].sum())
        torch.testing.assert_close(x.grad[start:start + rows.shape[0]].double(), ref_dx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad[e].double(), ref_dw, rtol=1e-5, atol=1e-5)
