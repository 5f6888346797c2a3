"""The compiled loss head (training/compiled_loss.py) against torch's own cross entropy: loss sums, token counts
and the gradients reaching the logits' producer, with ignored labels, a partial mask, a non-unit incoming
gradient and bf16 logits; the backward written over the logits never gives a wrong gradient silently."""
import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.training.compiled_loss import compiled_masked_loss_sum

TOKENS, HIDDEN, VOCAB = 24, 16, 96


def _inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(2, TOKENS // 2, HIDDEN, generator=gen, dtype=dtype, requires_grad=True)
    head = torch.randn(VOCAB, HIDDEN, generator=gen, dtype=dtype).mul(0.3).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=gen)
    labels[0, 1] = labels[1, 4] = -100  # ignored by F.cross_entropy: no loss, no gradient, still counted by the mask
    loss_mask = (torch.rand(2, TOKENS // 2, generator=gen) > 0.3).float()
    return hidden, head, labels, loss_mask


def _reference(hidden, head, labels, loss_mask, scale):
    """torch's cross entropy in fp32 on the same logits: (loss sum, count, d hidden, d head)."""
    logits = hidden @ head.t()
    losses = F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    loss_sum, count = (losses * loss_mask.reshape(-1)).sum(), loss_mask.sum()
    (loss_sum * scale).backward()
    return loss_sum.detach(), count, hidden.grad, head.grad


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sums_and_gradients_equal_torch_cross_entropy(dtype, tol):
    hidden, head, labels, loss_mask = _inputs(dtype)
    ref_sum, ref_count, ref_dh, ref_dw = _reference(hidden, head, labels, loss_mask, 0.37)
    hidden.grad = head.grad = None
    loss_sum, count = compiled_masked_loss_sum(hidden @ head.t(), labels, loss_mask)
    (loss_sum * 0.37).backward()
    assert count.item() == ref_count.item() and count.item() < TOKENS
    torch.testing.assert_close(loss_sum, ref_sum, rtol=1e-5, atol=0)
    for got, want in ((hidden.grad, ref_dh), (head.grad, ref_dw)):
        assert got.dtype == dtype
        assert ((got.float() - want.float()).abs().max() / want.float().abs().max()).item() < tol


def test_a_view_of_the_logits_and_evaluation_without_autograd():
    hidden, head, labels, loss_mask = _inputs()
    ref_sum, _, ref_dh, _ = _reference(hidden, head, labels, loss_mask, 1.0)
    hidden.grad = head.grad = None
    logits = hidden @ head.t()
    loss_sum, _ = compiled_masked_loss_sum(logits.view_as(logits), labels, loss_mask)  # as MTP's attach returns
    loss_sum.backward()
    torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        eval_sum, _ = compiled_masked_loss_sum(hidden @ head.t(), labels, loss_mask)
    torch.testing.assert_close(eval_sum, ref_sum, rtol=1e-5, atol=0)


def test_a_second_backward_is_refused():
    hidden, head, labels, loss_mask = _inputs()
    loss_sum, _ = compiled_masked_loss_sum(hidden @ head.t(), labels, loss_mask)
    loss_sum.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss_sum.backward()


@pytest.mark.parametrize("square_first", [True, False])
def test_logits_saved_by_another_op_never_give_a_wrong_gradient(square_first):
    """An op that saved the logits for its own backward either runs its backward first (right gradient) or finds
    them overwritten (autograd's error): the hidden states' gradient is never silently wrong. Autograd runs the
    newer node first, so `square_first` gives the error, the other order the gradient."""
    hidden, head, labels, loss_mask = _inputs()
    logits = hidden @ head.t()
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    ((losses * loss_mask.reshape(-1)).sum() + 0.01 * (logits ** 2).sum()).backward()
    ref_dh = hidden.grad.clone()
    hidden.grad = head.grad = None
    logits = hidden @ head.t()
    square = 0.01 * (logits ** 2).sum() if square_first else None
    loss_sum, _ = compiled_masked_loss_sum(logits, labels, loss_mask)
    if square is None:
        square = 0.01 * (logits ** 2).sum()
    try:
        (loss_sum + square).backward()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
    else:
        torch.testing.assert_close(hidden.grad, ref_dh, rtol=1e-5, atol=1e-6)
