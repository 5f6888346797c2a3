"""Grouped GEMM (torch grouped_mm) against the plain per-expert loop and a naive per-row reference."""
import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.kernels.grouped_gemm import grouped_linear, grouped_mm_supported, select_backend

needs_grouped_mm = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch without grouped_mm")


def _naive(x, weight, counts):
    """Row by row, independent of both backends: expert id of each row from the counts."""
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return torch.stack([weight[e] @ row for row, e in zip(x, expert_of_row.tolist())])


def _run(backend, x, weight, counts, grad_out):
    x = x.clone().requires_grad_()
    weight = weight.clone().requires_grad_()
    y = grouped_linear(x, weight, counts, backend=backend)
    y.backward(grad_out)
    return y.detach(), x.grad, weight.grad


@needs_grouped_mm
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7, 0], [4, 4, 4, 4]])
def test_grouped_mm_equals_loop_forward_backward(counts):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    x, weight = torch.randn(int(counts.sum()), 32), torch.randn(4, 16, 32)
    grad_out = torch.randn(x.shape[0], 16)
    assert select_backend(x, weight, use_grouped_gemm=True) == "grouped_mm"
    loop = _run("loop", x, weight, counts, grad_out)
    grouped = _run("grouped_mm", x, weight, counts, grad_out)
    torch.testing.assert_close(loop[0], _naive(x, weight, counts), rtol=1e-5, atol=1e-5)
    for a, b in zip(grouped, loop):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counts[1] > 0 or float(grouped[2][1].abs().sum()) == 0.0  # an idle expert gets a zero gradient


@needs_grouped_mm
def test_stride_zero_gradient_from_sum():
    """`.sum()` hands backward an expanded (stride-0) gradient, which grouped_mm alone rejects."""
    torch.manual_seed(1)
    x = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(2, 4, 8, requires_grad=True)
    grouped_linear(x, weight, torch.tensor([2, 4]), backend="grouped_mm").sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    grouped_linear(ref_x, ref_w, torch.tensor([2, 4]), backend="loop").sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(weight.grad, ref_w.grad)


def test_unaligned_layout_falls_back_to_loop():
    """5 fp32 columns = 20-byte rows: not a multiple of 16 bytes, so grouped_mm is not used."""
    x, weight = torch.randn(4, 5), torch.randn(2, 3, 5)
    assert not grouped_mm_supported(x, weight)
    assert select_backend(x, weight, use_grouped_gemm=True) == "loop"
    assert select_backend(torch.randn(4, 8), torch.randn(2, 4, 8), use_grouped_gemm=False) == "loop"
    assert select_backend(torch.randn(0, 8), torch.randn(2, 4, 8), use_grouped_gemm=True) == "loop"
    y = grouped_linear(x, weight, torch.tensor([1, 3]))
    torch.testing.assert_close(y, _naive(x, weight, torch.tensor([1, 3])))


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown grouped GEMM backend"):
        grouped_linear(torch.randn(2, 4), torch.randn(1, 4, 4), torch.tensor([2]), backend="cublas")
