"""kernels/varlen: position ids <-> cu_seqlens, against a plain Python walk over the rows."""
import torch

from fsdp2_backend.kernels.varlen import cu_seqlens_from_position_ids, is_packed, position_ids_from_cu_seqlens


def _python_cu_seqlens(rows):
    cu, offset = [0], 0
    for row in rows:
        for i, p in enumerate(row):
            if i > 0 and p == 0:
                cu.append(offset + i)
        offset += len(row)
        cu.append(offset)
    return cu


def test_cu_seqlens_matches_python_walk_and_round_trips():
    rows = [[0, 1, 2, 0, 1, 0], [5, 6, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]  # row 2 starts mid-document
    position_ids = torch.tensor(rows)
    cu, max_len = cu_seqlens_from_position_ids(position_ids)
    assert cu.dtype == torch.int32
    assert cu.tolist() == _python_cu_seqlens(rows)
    assert max_len == 6
    back = position_ids_from_cu_seqlens(cu, 3, 6)
    expected = position_ids.clone()
    expected[1, :2] = torch.tensor([0, 1])  # a row start is a document start
    assert torch.equal(back, expected)


def test_is_packed():
    assert is_packed(torch.tensor([[0, 1, 0, 1]]))
    assert not is_packed(torch.arange(8).expand(2, 8))
    assert not is_packed(None)
