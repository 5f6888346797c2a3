"""kernels/gated_delta_rule_scan (the chunked rule's Function with its hand-written backward) where the other tests
do not reach: its gradients against numerical differentiation (`torch.autograd.gradcheck`, float64) for every input,
the initial states and through the final states — rows with two value heads on one key head, and packed
documents — with the block of chunks shrunk so that the forward and the reverse loop cross several blocks (a
document spans a block boundary); and a sequence of more chunks than the default block against the float64
sequential oracle.
"""
import pytest
import torch

import fsdp2_backend.kernels.gated_delta_rule_scan as scan
from fsdp2_backend.kernels.gated_delta_rule import chunk_gated_delta_rule_reference
from tests.support.kernel_references import gdn_grads, gdn_inputs, sequential_gated_delta_rule


def _leaves(batch, length, k_heads, heads, dk, dv, states, seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = rand(batch, length, k_heads, dk), torch.nn.functional.normalize(rand(batch, length, k_heads, dk), dim=-1)
    v = rand(batch, length, heads, dv)
    g = -torch.rand(batch, length, heads, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(batch, length, heads, generator=gen, dtype=torch.float64)
    init = rand(states, heads, dk, dv) * 0.1
    return [x.requires_grad_() for x in (q, k, v, g, beta, init)]


@pytest.mark.parametrize("block,packed", [(1, False), (3, True)])
def test_hand_written_backward_equals_numerical_gradients(monkeypatch, block, packed):
    monkeypatch.setattr(scan, "BLOCK", block)
    chunk = 4
    if packed:  # one row of 7 chunks; documents start at chunks 0, 1 and 3 (the last spans two blocks of 3)
        batch, length, starts = 1, 28, [0, 1, 3]
    else:  # two rows of 3 chunks, one chunk per block
        batch, length, starts = 2, 12, None
    leaves = _leaves(batch, length, 1, 2, 3, 2, len(starts) if packed else batch, seed=block + 10 * packed)

    def run(q, k, v, g, beta, init):
        return scan.chunked_scan(q, k, v, g, beta, chunk, starts, init)

    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_more_chunks_than_a_block_equal_the_sequential_oracle():
    inputs = gdn_inputs(1, 150, 2, 8, 6, torch.float32, seed=12)  # 19 chunks of 8 > BLOCK (16): two blocks
    assert 150 // 8 + 1 > scan.BLOCK
    init = torch.randn(1, 2, 8, 6, generator=torch.Generator().manual_seed(13)) * 0.1
    out, final = chunk_gated_delta_rule_reference(*inputs, chunk_size=8, initial_state=init, output_final_state=True)
    expected, expected_final = sequential_gated_delta_rule(*inputs, initial_state=init)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(final.double(), expected_final, atol=2e-5, rtol=1e-4)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(14))
    got, want = gdn_grads(out, inputs, weight), gdn_grads(expected, inputs, weight.double())
    for name, a, b in zip("q k v g beta".split(), got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4, msg=f"grad of {name}")
