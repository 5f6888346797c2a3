"""The MTP tensor-parallel runs' steps: the same batches, loss (lm loss + FACTOR x MTP loss) and optimizer steps for
a 1-rank run and a parallel layout (`train_steps`)."""
from __future__ import annotations

import torch

STEPS, LR, SEQ, MBS, FACTOR = 3, 5e-3, 16, 2, 0.3


def _batch(step):
    from fsdp2_backend.models.mtp import mtp_batch

    g = torch.Generator().manual_seed(1000 * (step % 2))  # two batches in turn: the loss must fall
    text = torch.randint(0, 128, (MBS, SEQ + 1), generator=g)
    mask = torch.ones(MBS, SEQ)
    mask[1, 3 + step] = 0
    return mtp_batch(dict(input_ids=text[:, :-1], labels=text[:, 1:], loss_mask=mask,
                          position_ids=torch.arange(SEQ).expand(MBS, SEQ)), 1)


def _loss(model, batch):
    """(lm loss + FACTOR x MTP loss, detached), after its backward."""
    import torch.nn.functional as F

    from fsdp2_backend.models.mtp import mtp_forward

    out, sums, counts = mtp_forward(model, batch, 1, lambda s, c: FACTOR * s[0] / c[0])
    ce = F.cross_entropy(out.logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten()
    lm = (ce * mask).sum() / mask.sum()
    lm.backward()
    return float(lm.detach() + FACTOR * sums[0] / counts[0])


def train_steps(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        losses.append(_loss(model, _batch(step)))
        opt.step()
    return losses
