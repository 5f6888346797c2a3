"""Regional compilation (`optimization.torch_compile`): each decoder block compiled once with `torch.compile`.

Compiling the repeated block rather than the whole model is torchtitan's way (`apply_compile`): every block has
the same code, so dynamo traces one graph and the other blocks reuse it (one compile, not one per layer), and
what breaks graphs outside the blocks (the embedding, the data path, FSDP's root hooks) stays eager.

Where it sits in the plan (`parallel.apply`): after TP, EP, CP, recompute and ChunkMBS, before FSDP — the order
torch's composability rules and torchtitan use. The compiled region then holds the DTensor (TP) ops and the
context-parallel attention, while FSDP2's per-unit hooks, registered afterwards around the block's call, run
outside it (dynamo skips FSDP hooks, `torch._dynamo.config.skip_fsdp_hooks`). A block recomputed whole keeps its
checkpoint outside the compiled forward (see `apply_compile`); selective recompute of a piece inside the block
is a graph break at that piece, which then runs eager.

In place: `nn.Module.compile()` keeps the module where it was, so parameter names, state-dict keys, checkpoints
and every later plan pattern are unchanged (a `torch.compile(block)` wrapper would add `_orig_mod.` to them).

The loss head (cross entropy over the logits) is compiled as well, by the trainer that calls it: two kernels,
the backward written over the logits (`training/compiled_loss.py`).

Not fullgraph: a block that hits a graph break (an op dynamo cannot trace) still runs, its traceable pieces
compiled. Every model id compiles (benchmarks/compile_model_ids.py lists graphs and breaks per id); blocks with
routed experts compile in pieces around the token dispatch, said once by config validation (config/
rules/optimization.py). Ops that are already hand-fused or data-dependent run eager inside the compiled region
(`torch.compiler.disable`: the experts' grouped GEMM, Gated DeltaNet's CPU scan).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from fsdp2_backend.parallel.recompute import wrap_recomputed


def decoder_blocks(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """(name, module) of the model's repeated decoder blocks: the modules of transformers' `_no_split_modules`
    classes that are items of a list (`model.layers.3`, GPT-2's `transformer.h.3`), in model order."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    # by the class's ancestry: fully_shard swaps a unit's class for an FSDP subclass of it
    return [(name, module) for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1].isdigit() and any(c.__name__ in block_classes for c in type(module).__mro__)]


def apply_compile(model: nn.Module) -> List[str]:
    """Compiles each decoder block of `model` in place; returns their names (empty: the model has none)."""
    # MoE routing reads counts back as Python ints (tokens per expert): without this each such read is a graph
    # break (torchtitan sets it for its token-choice MoE too)
    torch._dynamo.config.capture_scalar_outputs = True
    blocks = decoder_blocks(model)
    for _, block in blocks:
        # A recomputed block (full recompute): the checkpoint stays outside and runs the compiled forward, once
        # in forward and again in backward. Inside a compiled region the checkpoint would be traced as a
        # higher-order op that refuses side effects, and transformers' attention sets a ContextVar (the `kernels`
        # package's forward wrapper): dynamo would give up on the whole block and run it eager.
        if not wrap_recomputed(block, torch.compile):
            block.compile()
    return [name for name, _ in blocks]
