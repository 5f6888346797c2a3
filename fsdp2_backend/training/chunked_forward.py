"""`optimization.chunk_loss_size`: the language-model loss of one forward, computed chunk by chunk from the final
hidden states, inside the FSDP2 root's own forward call.

How: for one call of the model, the lm head's `forward` is replaced by one that receives the final hidden states
where transformers' causal-LM forward would compute the full logits, and returns [loss sum, token count] from
`loss.chunked_masked_loss_sum`, which runs the head's own forward once per chunk (each chunk's logits are
recomputed in backward, so at most one chunk of logits exists at a time). Why this way rather than calling the
base model (`model.model`) directly:
- the root module is called as usual, so its FSDP2 hooks (lazy init, unshard of root-owned parameters such as
  tied embeddings and the final norm, pre-backward on its outputs) and any other hooks on it run unchanged;
- the lm head module is called once, as usual, so when it is its own FSDP unit its hooks run once per step: it is
  unsharded around the chunk loop, unsharded again for the recomputation in backward (its pre-backward hook sits
  on the loss it returned) and reduce-scatters once all chunks' gradients reached its input;
- the module tree is never changed, and everything else the causal-LM forward computes stays transformers' own,
  notably the MoE aux loss (`outputs.aux_loss`).
Declined: models that post-process the logits in forward (`final_logit_softcapping`: it would act on the loss)
and, for now, tensor parallel (the head's DTensor hooks would hand the loop a DTensor; not tested).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor, nn

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.training.loss import chunked_masked_loss_sum


def check_chunked_loss_model(model: nn.Module) -> None:
    """Raises UsageError when `model`'s forward cannot host the chunked loss."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise UsageError(f"optimization.chunk_loss_size: {type(model).__name__} has no lm head to chunk — unset "
                         f"chunk_loss_size")
    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        raise UsageError("optimization.chunk_loss_size: this model soft-caps its logits in forward, which the "
                         "chunked loss cannot reproduce — unset chunk_loss_size")


def chunked_loss_forward(model: nn.Module, input_ids: Tensor, position_ids: Optional[Tensor], labels: Tensor,
                         loss_mask: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """(masked loss sum, loss-token count, unweighted MoE aux loss or None) of one forward of `model` (the FSDP
    root, a transformers causal LM), the loss computed `chunk_size` tokens at a time. Labels are aligned with
    input_ids (Megatron style)."""
    head = model.get_output_embeddings()
    own_forward = head.__dict__.get("forward")  # an instance-level forward (rare) must come back as it was
    plain_forward = head.forward

    def loss_head(hidden: Tensor) -> Tensor:
        loss_sum, count = chunked_masked_loss_sum(hidden, plain_forward, labels, loss_mask, chunk_size)
        return torch.stack([loss_sum, count])

    head.forward = loss_head
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        if own_forward is None:
            del head.forward
        else:
            head.forward = own_forward
    loss_sum, count = out.logits.reshape(2).unbind()
    return loss_sum, count.detach(), getattr(out, "aux_loss", None)
