"""Context parallel for the DeepSeek-sparse-attention (DSA) model ids, `deepseek_v4` and `glm52`: MindSpeed-LLM's
`cp_type: kvallgather`.

A DSA layer picks each query's keys from its whole causal prefix (the lightning indexer's top-k; DeepSeek-V4 also
compresses the keys in windows of the sequence), so neither Ulysses (which hands the inner attention a head slice
of the whole sequence but not the indexer) nor ring (which never holds every key at once) can run it. Here each cp
rank keeps its own queries (the layout `batch.shard_batch_for_cp` gave them) and all-gathers, with gradient, what
the keys are made from; the per-model modules (`dsa_deepseek_v4.py`, `dsa_glm.py`) replace the attention
module's forward with one that computes the same values as transformers' at cp 1 for this rank's queries.

`enable_dsa_context_parallel` is the one entry point (`parallel/apply.py`): it returns True when it made the model
context parallel, and the generic attention CP is then not applied.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def enable_dsa_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str) -> bool:
    """Makes every DSA attention of `model` context parallel over `cp_mesh` (1-D); False for other models."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    if any(isinstance(m, dv4.DeepseekV4Attention) for m in model.modules()):
        from fsdp2_backend.parallel.context_parallel.dsa_deepseek_v4 import enable_deepseek_v4_context_parallel

        enable_deepseek_v4_context_parallel(model, cp_mesh, cp_type)
        return True
    if any(isinstance(m, glm.GlmMoeDsaAttention) for m in model.modules()):
        from fsdp2_backend.parallel.context_parallel.dsa_glm import enable_glm_context_parallel

        enable_glm_context_parallel(model, cp_mesh, cp_type)
        return True
    return False
