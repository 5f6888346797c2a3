"""Megatron loss semantics against naive per-token loops (single process; the 2-rank reduction is covered in
test_grad_clip.py, which checks loss and grad norm against a 1-rank run)."""
import math

import torch

from fsdp2_backend.training.loss import GlobalBatchLoss, chunked_masked_loss_sum, masked_loss_sum

V, H = 11, 6


def _batch(seed, b=2, s=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, V, generator=g)
    labels = torch.randint(0, V, (b, s), generator=g)
    mask = (torch.rand(b, s, generator=g) > 0.3).float()
    return logits, labels, mask


def _naive(logits, labels, mask):
    total, count = 0.0, 0
    for i in range(labels.shape[0]):
        for j in range(labels.shape[1]):
            if mask[i, j]:
                row = logits[i, j].double()
                total += (torch.logsumexp(row, 0) - row[labels[i, j]]).item()
                count += 1
    return total, count


def test_masked_sum_and_count_match_a_token_loop():
    logits, labels, mask = _batch(0)
    loss_sum, tokens = masked_loss_sum(logits, labels, mask)
    ref_sum, ref_count = _naive(logits, labels, mask)
    assert tokens.item() == ref_count
    assert math.isclose(loss_sum.item(), ref_sum, rel_tol=1e-5)


def test_chunked_loss_equals_full_loss_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False)
    hidden = torch.randn(2, 7, H, requires_grad=True)
    labels = torch.randint(0, V, (2, 7))
    mask = (torch.rand(2, 7) > 0.2).float()
    full_sum, full_n = masked_loss_sum(head(hidden), labels, mask)
    full_sum.backward()
    grads = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad = None
    head.weight.grad = None
    chunk_sum, chunk_n = chunked_masked_loss_sum(hidden, head, labels, mask, chunk_size=3)  # 14 = 3+3+3+3+2
    chunk_sum.backward()
    assert chunk_n.item() == full_n.item()
    torch.testing.assert_close(chunk_sum, full_sum, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(head.weight.grad, grads[1], rtol=1e-5, atol=1e-7)


def _accumulate(per_token):
    torch.manual_seed(1)
    head = torch.nn.Linear(H, V)
    batches = [(torch.randn(2, 4, H), *_batch(10 + k, s=4)[1:]) for k in range(3)]
    batches[1][2][:] = 0.0
    batches[1][2][0, :2] = 1.0  # micro-batches with different token counts
    acc = GlobalBatchLoss(num_microbatches=3, dp_size=1, calculate_per_token_loss=per_token)
    for hidden, labels, mask in batches:
        acc.backward_loss(*masked_loss_sum(head(hidden), labels, mask)).backward()
    reported = acc.finish(head.parameters())
    return head, batches, reported


def test_megatron_mean_of_microbatch_means_and_token_weighted_report():
    torch.manual_seed(1)
    head0 = torch.nn.Linear(H, V).state_dict()
    head, batches, reported = _accumulate(per_token=False)
    ref = torch.nn.Linear(H, V)
    ref.load_state_dict(head0)
    sums = [masked_loss_sum(ref(h), y, m) for h, y, m in batches]
    (sum(s / n for s, n in sums) / 3).backward()
    torch.testing.assert_close(head.weight.grad, ref.weight.grad)
    token_weighted = sum(s for s, _ in sums).item() / sum(n for _, n in sums).item()
    assert math.isclose(reported, token_weighted, rel_tol=1e-6)
    mean_of_means = (sum(s / n for s, n in sums) / 3).item()
    assert not math.isclose(reported, mean_of_means, rel_tol=1e-4)  # the report is token-weighted, not this


def test_per_token_loss_divides_gradients_by_the_global_token_count():
    torch.manual_seed(1)
    head0 = torch.nn.Linear(H, V).state_dict()
    head, batches, reported = _accumulate(per_token=True)
    ref = torch.nn.Linear(H, V)
    ref.load_state_dict(head0)
    sums = [masked_loss_sum(ref(h), y, m) for h, y, m in batches]
    (sum(s for s, _ in sums) / sum(n for _, n in sums)).backward()
    torch.testing.assert_close(head.weight.grad, ref.weight.grad)
    torch.testing.assert_close(head.bias.grad, ref.bias.grad)
    assert math.isclose(reported, sum(s for s, _ in sums).item() / sum(n for _, n in sums).item(), rel_tol=1e-6)
