"""The configure and checkpoint hooks the MoE model ids' specs name (`models/<id>/spec.py`): a run's switches
(grouped GEMM, fix_router, Megatron's router fields, the DSA indexer loss, Gated DeltaNet kernels) → the model's own
configure calls, and the stacked-expert checkpoint keys (transformers' per-expert gate/up/down keys) sized by the HF
config's expert count, for qwen3_moe and the family-swap ids (models/moe/family_swap.py's FAMILIES).
"""
from __future__ import annotations

from typing import List, Mapping

import torch
from torch import nn

from fsdp2_backend.models.moe.family_swap import FAMILIES
from fsdp2_backend.models.qwen3_moe import modeling as qwen3_moe


def configure_moe_run(model: nn.Module, config, device_type: str) -> None:  # noqa: ARG001 — the hooks' signature
    """Grouped GEMM, fix_router and Megatron's router fields (qwen3_moe, gpt_oss and the family-swap ids)."""
    qwen3_moe.configure_moe(model, moe_grouped_gemm=config.optimization.moe_grouped_gemm,
                            fix_router=config.optimization.fix_router, model_args=config.model)


def configure_indexed_moe_run(model: nn.Module, config, device_type: str) -> None:
    """`configure_moe_run`, plus MindSpeed's DSA indexer KL loss when training.indexer_loss_coeff asks (glm52)."""
    configure_moe_run(model, config, device_type)
    if config.training.indexer_loss_coeff:  # training only
        from fsdp2_backend.models.dsa_indexer_loss import install_glm52

        install_glm52(model, config.training.indexer_loss_coeff)


def configure_qwen3_next_run(model: nn.Module, config, device_type: str) -> None:
    """Qwen3-Next's switches: the MoE ones, and the Gated DeltaNet kernels chosen for `device_type`."""
    from fsdp2_backend.kernels.gated_delta_rule import gdn_implementation
    from fsdp2_backend.models.qwen3_next.modeling import configure_qwen3_next

    o = config.optimization
    configure_qwen3_next(model, moe_grouped_gemm=o.moe_grouped_gemm, fix_router=o.fix_router,
                         gdn_chunk_size=o.gdn_chunk_size,
                         gdn_implementation=gdn_implementation(device_type, use_triton_gdn=o.use_triton_gdn,
                                                               use_flash_gdn=o.use_flash_gdn),
                         fused_gated_norm=o.use_triton_rmsnormgated, model_args=config.model)


def expert_checkpoint_keys(name: str, hf_config) -> List[str]:
    """The per-expert checkpoint keys of a stacked-expert parameter (transformers' Qwen3-MoE layout)."""
    return qwen3_moe.checkpoint_keys(name, hf_config.num_experts)


def expert_from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    """A stacked-expert parameter assembled from its per-expert checkpoint tensors."""
    return qwen3_moe.param_from_checkpoint(name, tensors, hf_config.num_experts)


def family_checkpoint_keys(name: str, hf_config) -> List[str]:
    """`expert_checkpoint_keys` for a family-swap model (its family counts the experts its own way)."""
    return qwen3_moe.checkpoint_keys(name, FAMILIES[hf_config.model_type].num_experts(hf_config))


def family_from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    """`expert_from_checkpoint` for a family-swap model."""
    return qwen3_moe.param_from_checkpoint(name, tensors, FAMILIES[hf_config.model_type].num_experts(hf_config))
