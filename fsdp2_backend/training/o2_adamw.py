"""MindSpeed-LLM's O2 optimizer (`--o2-optimizer`, native `training.o2_optimizer`): AdamW whose two moments are
kept in bf16 between steps.

What MindSpeed-LLM does (mindspeed_llm/tasks/models/common/adamw.py, `O2AdamW`, patched in for apex's FusedAdam):
`exp_avg` and `exp_avg_sq` are created in bf16; every step casts them to fp32, runs the AdamW update in fp32 on the
(fp32 main) parameters, and stores the moments back in bf16 — 4 bytes per parameter saved. The parameters
themselves are untouched by O2: here they are FSDP2's fp32 sharded parameters (bf16 is only the compute copy), as
Megatron's fp32 main parameters are.

`BF16StateAdamW` is torch.optim.AdamW with that storage: the update is torch's own functional AdamW
(`torch.optim.adam.adam`, decoupled weight decay), run one parameter at a time on fp32 copies of its moments so
only one parameter's fp32 moments exist at once; the state dict (DCP checkpoints) holds the bf16 moments. The step
count and bias correction are torch's (beta^t): MindSpeed feeds torch_npu's `npu_apply_adam_w` kernel beta powers of
step - 1, a kernel convention torch_npu does not document, so that one detail is not mirrored. Written here because
torch has no AdamW with low-precision state and torchao's low-bit optimizers quantise blockwise (8/4-bit), which
is not what O2 does.
"""
from __future__ import annotations

import torch
from torch.optim.adam import adam

from fsdp2_backend.training.param_steps import params_with_grad, run_closure

_MOMENTS = ("exp_avg", "exp_avg_sq")


class BF16StateAdamW(torch.optim.AdamW):
    """AdamW with bf16 moments (MindSpeed's O2); same constructor and param groups as torch.optim.AdamW."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            if group["amsgrad"]:
                raise ValueError("BF16StateAdamW: amsgrad is not part of MindSpeed's O2 optimizer")

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group, p, state in params_with_grad(self):
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in _MOMENTS:
                    state[key] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.preserve_format)
            moments = [state[key].float() for key in _MOMENTS]
            beta1, beta2 = group["betas"]
            adam([p], [p.grad], moments[:1], moments[1:], [], [state["step"]], foreach=False,
                 decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                 weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            for key, value in zip(_MOMENTS, moments):
                state[key].copy_(value)  # rounds to bf16, as MindSpeed's copy back does
        return loss
