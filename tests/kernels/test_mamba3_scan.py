"""The chunked Mamba-3 scan (`kernels.mamba3_scan.mamba3_chunk_scan`) against the sequential recurrence.

The oracle below is the token-by-token recurrence of the paper / mamba_ssm's step reference (state h, the
previous token's rotated key and value kept as state, the angle accumulated mod 2π step by step), written
independently of the chunked code. Values and gradients of every input; SISO and MIMO; several chunk sizes;
lengths that are not a multiple of the chunk; packed documents equal to separate runs.
"""
from __future__ import annotations

import pytest
import torch

from fsdp2_backend.kernels.mamba3_scan import mamba3_chunk_scan

from tests.support.kernel_references import mamba3_inputs as _inputs, sequential_oracle


@pytest.mark.parametrize("rank,chunk,length", [(1, 4, 13), (1, 8, 16), (1, 16, 7), (2, 4, 11), (3, 5, 12)])
def test_chunked_scan_equals_sequential_oracle(rank, chunk, length):
    inputs = _inputs(2, length, rank, 3, 8, 4, 2, seed=rank * 100 + chunk)
    got = mamba3_chunk_scan(*inputs, chunk_size=chunk)
    ref = sequential_oracle(*inputs)
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-5)
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(7))
    g_got = torch.autograd.grad(got, inputs, dy)
    g_ref = torch.autograd.grad(ref, inputs, dy.double())
    for name, a, b in zip(("q", "k", "v", "adt", "dt", "trap", "angles"), g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"d{name}")


def test_chunk_size_does_not_change_the_result():
    inputs = _inputs(1, 37, 1, 2, 8, 4, 4, seed=5)  # all pairs rotated (a = n / 2)
    ref = sequential_oracle(*inputs)
    for chunk in (1, 3, 8, 64):
        torch.testing.assert_close(mamba3_chunk_scan(*inputs, chunk_size=chunk).double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rank,chunk", [(1, 4), (2, 3)])
def test_packed_documents_equal_separate_runs(rank, chunk):
    lengths = [5, 1, 9, 6]  # boundaries inside chunks, on chunk edges, a one-token document
    total = sum(lengths)
    inputs = _inputs(1, total, rank, 2, 6, 3, 2, seed=11)
    doc_start = torch.zeros(1, total, dtype=torch.bool)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    doc_start[0, starts] = True
    packed = mamba3_chunk_scan(*inputs, chunk_size=chunk, doc_start=doc_start)
    separate = torch.cat([mamba3_chunk_scan(*(t[:, s:s + n] for t in inputs), chunk_size=chunk)
                          for s, n in zip(starts, lengths)], dim=1)
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.double(), sequential_oracle(*inputs, doc_start=doc_start), rtol=1e-4, atol=1e-5)
    dy = torch.randn(packed.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(packed, inputs, dy), torch.autograd.grad(separate, inputs, dy)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_rows_of_a_batch_reset_independently():
    inputs = _inputs(2, 10, 1, 2, 4, 2, 1, seed=2)
    doc_start = torch.zeros(2, 10, dtype=torch.bool)
    doc_start[0, 4] = True
    doc_start[1, 7] = True
    got = mamba3_chunk_scan(*inputs, chunk_size=3, doc_start=doc_start)
    torch.testing.assert_close(got.double(), sequential_oracle(*inputs, doc_start=doc_start), rtol=1e-4, atol=1e-5)
