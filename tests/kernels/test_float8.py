"""FP8 recipes (kernels/float8.py) against a block-by-block reference written here: each block's scale is
fp8_max / amax (a power of two below it for rowwise / blockwise), elements cast by torch to E4M3 / E5M2 and back;
the three GEMMs of `float8_linear` quantise each operand along its reduction dim as the recipe table says."""
import math

import pytest
import torch

from fsdp2_backend.kernels.float8 import fake_quantize, float8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _reference(x, block, dtype, pow2):
    """Loops over the blocks of 2-D x (block dims 0 = whole dim); no padding needed when the dims divide."""
    rows, cols = x.shape
    br, bc = block[0] or rows, block[1] or cols
    out = torch.empty(rows, cols)
    fmax = torch.finfo(dtype).max
    for i in range(0, rows, br):
        for j in range(0, cols, bc):
            tile = x[i:i + br, j:j + bc].float()
            scale = fmax / max(float(tile.abs().max()), 1e-12)
            if pow2:
                scale = 2.0 ** math.floor(math.log2(scale))
            out[i:i + br, j:j + bc] = (tile * scale).clamp(-fmax, fmax).to(dtype).float() / scale
    return out


def _x(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-2, 1, rows).unsqueeze(1)  # rows of other sizes
    return x


@pytest.mark.parametrize("block, dtype, pow2", [((0, 0), E4M3, False), ((1, 0), E4M3, True), ((1, 128), E5M2, True),
                                                 ((128, 128), E4M3, True)])
def test_fake_quantize_equals_the_blockwise_reference(block, dtype, pow2):
    x = _x(256, 384, 1)
    got = fake_quantize(x, block, dtype, pow2)
    torch.testing.assert_close(got, _reference(x, block, dtype, pow2), rtol=0, atol=0)
    assert not torch.equal(got, x)


def test_a_tensor_whose_amax_is_the_format_max_is_a_plain_cast():
    x = _x(8, 16, 2)
    x = x / x.abs().max() * 448.0
    torch.testing.assert_close(fake_quantize(x, (0, 0)), x.to(E4M3).float(), rtol=0, atol=0)


def test_blocks_keep_small_values_that_one_tensor_scale_flushes():
    x = torch.full((128, 256), 1e-6)
    x[0, 0] = 1e4  # one outlier: with one scale the rest underflows E4M3; in the other 128x128 block it does not
    assert fake_quantize(x, (0, 0))[0, 200] == 0
    torch.testing.assert_close(fake_quantize(x, (128, 128), pow2=True)[0, 200], torch.tensor(1e-6), rtol=0.07, atol=0)


def test_padding_a_block_changes_nothing():
    x = _x(5, 200, 3)  # 200 = 128 + 72: the second block zero-padded
    padded = torch.nn.functional.pad(x, (0, 56))
    torch.testing.assert_close(fake_quantize(x, (1, 128), pow2=True), _reference(padded, (1, 128), E4M3, True)[:, :200],
                               rtol=0, atol=0)


@pytest.mark.parametrize("recipe, grad_format", [("tensorwise", "hybrid"), ("rowwise", "e4m3"),
                                                 ("blockwise", "hybrid")])
def test_float8_linear_gemms_follow_the_recipe(recipe, grad_format):
    pow2 = recipe != "tensorwise"
    blocks = {"tensorwise": dict(x=(0, 0), w=(0, 0), g=(0, 0)), "rowwise": dict(x=(1, 0), w=(1, 0), g=(1, 0)),
              "blockwise": dict(x=(1, 128), w=(128, 128), g=(1, 128))}[recipe]
    gdt = E5M2 if grad_format == "hybrid" else E4M3
    x = _x(256, 128, 4).reshape(2, 128, 128).requires_grad_()
    w = (_x(256, 128, 5) / 10).requires_grad_()
    bias = torch.randn(256, generator=torch.Generator().manual_seed(6)).requires_grad_()
    dy = _x(256, 256, 7).reshape(2, 128, 256)
    out = float8_linear(x, w, bias, recipe=recipe, grad_format=grad_format)
    out.backward(dy)
    x2, d2 = x.detach().reshape(256, 128), dy.reshape(256, 256)
    q = lambda t, b, dt=E4M3: _reference(t.contiguous(), b, dt, pow2)  # noqa: E731
    # an FP8 GEMM: exact products of the dequantised operands, a wide accumulator (fp64 here), one rounding
    mm = lambda a, b: (a.double() @ b.double().t()).float()  # noqa: E731
    want_out = mm(q(x2, blocks["x"]), q(w.detach(), blocks["w"])) + bias.detach()
    want_dx = mm(q(d2, blocks["g"], gdt), q(w.detach().t(), blocks["w"]))
    want_dw = mm(q(d2.t(), blocks["g"], gdt), q(x2.t(), blocks["x"]))
    torch.testing.assert_close(out.detach().reshape(256, 256), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.reshape(256, 128), want_dx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, want_dw, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bias.grad, d2.sum(0))
    plain = torch.nn.functional.linear(x.detach(), w.detach(), bias.detach())
    err = (out.detach() - plain).norm() / plain.norm()
    assert 1e-4 < err < 0.1  # quantised, and close
