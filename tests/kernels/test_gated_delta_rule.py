"""kernels/gated_delta_rule and kernels/causal_conv1d against sequential oracles written here.

The oracle of the gated delta rule is the recurrence itself, one token at a time in float64
(S <- exp(g) S; S <- S + beta k (v - k^T S)^T; o = S^T q / sqrt(K)); the conv oracle is a per-token sum over
the taps. Documents packed with cu_seqlens must equal the documents run one by one.
"""
import pytest
import torch

from fsdp2_backend.kernels.causal_conv1d import causal_conv1d, causal_conv1d_reference
from fsdp2_backend.kernels.gated_delta_rule import chunk_gated_delta_rule, chunk_gated_delta_rule_reference, gdn_implementation
from fsdp2_backend.usage_errors import UsageError

from tests.support.kernel_references import gdn_grads, gdn_inputs, sequential_gated_delta_rule


@pytest.mark.parametrize("chunk_size,length", [(64, 64), (16, 37), (8, 50), (32, 5)])
def test_chunked_rule_equals_sequential_oracle_fp32(chunk_size, length):
    inputs = gdn_inputs(2, length, 3, 8, 6, torch.float32)
    init = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(1)) * 0.1
    out, final = chunk_gated_delta_rule_reference(*inputs, chunk_size=chunk_size, initial_state=init,
                                                  output_final_state=True)
    expected, expected_final = sequential_gated_delta_rule(*inputs, initial_state=init)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final.double(), expected_final, atol=2e-5, rtol=1e-4)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = gdn_grads(out, inputs, weight)
    want = gdn_grads(expected, inputs, weight.double())
    for name, a, b in zip("q k v g beta".split(), got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4, msg=f"grad of {name}")


def test_bf16_inputs_accumulate_in_fp32():
    inputs = gdn_inputs(1, 45, 2, 16, 16, torch.bfloat16, seed=3)
    out, _ = chunk_gated_delta_rule_reference(*inputs, chunk_size=16)
    expected, _ = sequential_gated_delta_rule(*inputs)  # the same bf16 values, in float64
    assert out.dtype == torch.bfloat16
    # Only the final rounding to bf16 separates the two: within one bf16 ulp of the exact value.
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=8e-3)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    for a, b in zip(gdn_grads(out, inputs, weight), gdn_grads(expected, inputs, weight.double())):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b.double(), atol=3e-2, rtol=2e-2)


def test_grouped_value_heads_and_qk_l2norm():
    q, k, v, g, beta = gdn_inputs(1, 20, 4, 8, 8, torch.float32, seed=5, k_heads=2)
    out, _ = chunk_gated_delta_rule_reference(q, k, v, g, beta, chunk_size=8, use_qk_l2norm_in_kernel=True)
    qn, kn = (torch.nn.functional.normalize(x.double(), dim=-1, eps=0).repeat_interleave(2, dim=2) for x in (q, k))
    expected, _ = sequential_gated_delta_rule(qn, kn, v, g, beta)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk_size", [8, 16])
def test_packed_documents_reset_the_state(chunk_size):
    inputs = gdn_inputs(2, 30, 2, 8, 4, torch.float32, seed=6)
    cu = torch.tensor([0, 7, 30, 31, 47, 60], dtype=torch.int32)  # row 1 holds docs of 1, 16 and 13 tokens
    init = torch.randn(5, 2, 8, 4, generator=torch.Generator().manual_seed(7)) * 0.1
    out, finals = chunk_gated_delta_rule_reference(*inputs, chunk_size=chunk_size, cu_seqlens=cu,
                                                   initial_state=init, output_final_state=True)
    flat_out = out.reshape(60, 2, 4)
    flat = [x.reshape(1, 60, *x.shape[2:]) for x in inputs]
    weight = torch.randn(flat_out.shape, generator=torch.Generator().manual_seed(8))
    got = gdn_grads(flat_out, inputs, weight)
    want = [torch.zeros_like(x, dtype=torch.float64) for x in inputs]
    for d in range(5):
        a, b = int(cu[d]), int(cu[d + 1])
        doc = [x[:, a:b] for x in flat]
        expected, expected_final = sequential_gated_delta_rule(*doc, initial_state=init[d:d + 1])
        torch.testing.assert_close(flat_out[a:b].double(), expected[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(finals[d].double(), expected_final[0], atol=2e-5, rtol=1e-4)
        for acc, grad in zip(want, torch.autograd.grad((expected[0] * weight[a:b].double()).sum(), inputs,
                                                       allow_unused=True)):
            if grad is not None:
                acc += grad
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=1e-4)


def test_dispatch_runs_the_reference_on_cpu_and_declines_what_it_cannot_honour():
    inputs = gdn_inputs(1, 9, 1, 4, 4, torch.float32, seed=9)
    out, _ = chunk_gated_delta_rule(*inputs, chunk_size=4, implementation=gdn_implementation("cpu"))
    torch.testing.assert_close(out.double(), sequential_gated_delta_rule(*inputs)[0], atol=2e-5, rtol=1e-4)
    assert gdn_implementation("cpu", use_triton_gdn=True) == "torch"  # triton kernels need a GPU
    with pytest.raises(UsageError, match="use_flash_gdn"):
        gdn_implementation("cpu", use_flash_gdn=True)


def _conv_oracle(x, weight, bias, cu=None):
    batch, length, channels = x.shape
    x, weight = x.double(), weight.double()
    starts = [0] * (batch * length)
    if cu is not None:
        cu = cu.tolist()
        for d in range(len(cu) - 1):
            for t in range(cu[d], cu[d + 1]):
                starts[t] = cu[d]
    else:
        starts = [(t // length) * length for t in range(batch * length)]
    flat = x.reshape(batch * length, channels)
    out = torch.zeros_like(flat)
    width = weight.shape[1]
    for t in range(batch * length):
        acc = bias.double().clone() if bias is not None else torch.zeros(channels, dtype=torch.float64)
        for j in range(width):
            src = t - (width - 1) + j
            if src >= starts[t]:
                acc = acc + weight[:, j] * flat[src]
        out[t] = torch.nn.functional.silu(acc)
    return out.reshape(batch, length, channels)


@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_equals_oracle_and_transformers(with_bias):
    from transformers.models.qwen3_next.modeling_qwen3_next import causal_conv1d_fn

    gen = torch.Generator().manual_seed(10)
    x, weight = torch.randn(2, 11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    bias = torch.randn(6, generator=gen) if with_bias else None
    out = causal_conv1d(x, weight, bias)
    torch.testing.assert_close(out.double(), _conv_oracle(x, weight, bias), atol=1e-5, rtol=1e-5)
    hf = causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation="silu").transpose(1, 2)
    torch.testing.assert_close(out, hf)
    cu = torch.tensor([0, 11, 22], dtype=torch.int32)  # one document per row: the packed path, same answer
    torch.testing.assert_close(causal_conv1d_reference(x, weight, bias, cu_seqlens=cu), out, atol=1e-6, rtol=1e-6)


def test_causal_conv1d_resets_at_document_starts():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 9, 5, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 2, 9, 10, 18], dtype=torch.int32)
    out = causal_conv1d(x, weight, None, cu_seqlens=cu)
    torch.testing.assert_close(out.double(), _conv_oracle(x.detach(), weight.detach(), None, cu), atol=1e-5,
                               rtol=1e-5)
    # Gradients: the packed call equals the documents run separately.
    gx, gw = torch.autograd.grad(out.sum(), (x, weight))
    flat = x.reshape(1, 18, 5)
    pieces = [causal_conv1d(flat[:, a:b], weight) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ex, ew = torch.autograd.grad(torch.cat(pieces, dim=1).sum(), (x, weight))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew, atol=1e-5, rtol=1e-5)


def test_gdn_chunk_size_must_be_positive():
    from fsdp2_backend.config import Config
    from fsdp2_backend.config.validation import validate

    config = Config()
    config.optimization.gdn_chunk_size = 0
    with pytest.raises(UsageError, match="optimization.gdn_chunk_size: must be >= 1"):
        validate(config, 1)
