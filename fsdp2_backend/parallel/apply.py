"""The one place where a built model is made ready to train in parallel, in one fixed order:

    quantize → kernel swaps → model switches → model check → TP → EP → CP → recompute → ChunkMBS → compile → FSDP
    → gradient policy

Each stage is one function in its own module (`kernel_swaps`, the model's registry `configure`,
`tensor_parallel`, `expert_parallel`, `context_parallel`, `recompute`, `compile`, `fsdp`), skipped when its size is 1 or
its feature off. A stage returns the parameters it reduces itself (expert units), which FSDP must then ignore.
Quantisation comes first (`quantize`: MXFP8 linears and experts; after FSDP it settles each weight's
all-gather), then kernel swaps: context parallel wraps the attention chosen there. The gradient policy comes
last, once every FSDP unit exists. Compilation (`optimization.torch_compile`) wraps each decoder block after
every stage that changes what the block computes and before FSDP, whose hooks then stay outside the compiled
region (torchtitan's order).

Validation comes in two phases: the config alone before any process group (`fsdp2_backend.config.validation`),
then the model check (`parallel.model_checks`): the built model, its own switches applied, against the layout,
every problem of every stage at once, before the first stage changes it. The stages rely on both.
"""
from __future__ import annotations

from typing import Set

from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp2_backend.config import Config
from fsdp2_backend.distributed.context import ParallelContext
from fsdp2_backend.parallel.fsdp import apply_fsdp
from fsdp2_backend.parallel.kernel_swaps import apply_fused_ops
from fsdp2_backend.parallel.loss_hooks import register_loss_hooks
from fsdp2_backend.parallel.model_checks import check_built_model
from fsdp2_backend.parallel.recompute import apply_recompute


def _tensor_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.tensor_parallel import apply_tensor_parallel

    from fsdp2_backend.parallel.moe_tensor_parallel import token_local_blocks

    parallel = config.parallel
    experts = parallel.ep_modules if parallel.ep_size > 1 or parallel.ep_fsdp_size > 1 else ()
    # with EP the MoE blocks run on each rank's own tokens, experts not tensor-parallel (Megatron's etp 1)
    apply_tensor_parallel(model, ctx.tp_mesh, colwise=parallel.tp_colwise, rowwise=parallel.tp_rowwise,
                          sequence_parallel=parallel.sequence_parallel, exclude=experts,
                          token_local=token_local_blocks(model, experts))
    return set()  # TP parameters are DTensors on the tp mesh; FSDP shards them further over its own mesh


def _expert_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel

    return apply_expert_parallel(model, config, ctx)  # expert units are FSDP'd on their own mesh


def _context_parallel(model: nn.Module, config: Config, ctx: ParallelContext) -> Set[nn.Parameter]:
    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.dsa import enable_dsa_context_parallel
    from fsdp2_backend.parallel.context_parallel.linear_attention import enable_linear_attention_context_parallel

    if enable_dsa_context_parallel(model, ctx.cp_mesh, config.parallel.cp_type):  # deepseek_v4, glm52: kvallgather
        return set()
    # Gated DeltaNet layers (qwen3_next model id) go head-parallel first; the attention layers then use Ulysses/ring.
    linear = enable_linear_attention_context_parallel(model, ctx.cp_mesh, config.parallel.cp_type)
    enable_context_parallel(model, ctx.cp_mesh, config.parallel.cp_type, tp_size=config.parallel.tp_size,
                            handled_layer_types=("linear_attention",) if linear else ())
    return set()


def _model_switches(model: nn.Module, config: Config, device_type: str) -> None:
    """The model id's own run switches (e.g. grouped GEMM, fix_router; kernels chosen for `device_type`), before
    any stage wraps modules."""
    from fsdp2_backend.models.registry import model_spec

    if config.model.model_id:
        spec = model_spec(config.model.model_id)
        if spec.configure is not None:
            spec.configure(model, config, device_type)


def set_gradient_policy(model: nn.Module) -> None:
    """Every FSDP unit SUMs its gradients, with no division: the loss normaliser (`training.loss`) carries the
    1/(dp x cp) of Megatron's averaging. Forced SUM: FSDP2's AVG on gloo can sum (pytorch#162338) and gloo has
    no PREMUL_SUM, which a divide factor other than 1 would need."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def apply_parallelism(model: nn.Module, config: Config, ctx: ParallelContext) -> nn.Module:
    """Applies every configured stage to `model` in the fixed order; returns the FSDP root."""
    parallel = config.parallel
    quantized = config.model.quant_recipe_name is not None
    if quantized:
        from fsdp2_backend.parallel.quantize import apply_quantization

        apply_quantization(model, config, ctx.cp_mesh.get_group() if parallel.cp_size > 1 else None)
    apply_fused_ops(model, config.optimization, ctx.device.type)
    if config.data.neat_packing and config.data.data_manager_type == "lf":  # packed rows: varlen attention
        from fsdp2_backend.models.packed_attention import enable_packed_attention

        enable_packed_attention(model)
    _model_switches(model, config, ctx.device.type)
    check_built_model(model, config)  # the second validation phase: every stage's problems at once
    # the model-side loss terms (MoE routers, DSA indexer loss): their sums over ranks and optimizer-step hooks
    register_loss_hooks(model, ctx, tokens_split_over_tp=parallel.tp_size > 1 and (
        parallel.ep_size > 1 or parallel.ep_fsdp_size > 1))
    fsdp_ignored: Set[nn.Parameter] = set()
    if parallel.tp_size > 1:
        fsdp_ignored |= _tensor_parallel(model, config, ctx)
    if parallel.ep_size > 1 or parallel.ep_fsdp_size > 1:
        fsdp_ignored |= _expert_parallel(model, config, ctx)
    if parallel.cp_size > 1:
        fsdp_ignored |= _context_parallel(model, config, ctx)
    if parallel.recompute:
        apply_recompute(model, parallel.recompute_modules)
    if parallel.activation_offload_layers:  # saved activations on the host (parallel/offload.py)
        from fsdp2_backend.parallel.offload import apply_activation_offload

        apply_activation_offload(model, parallel.activation_offload_layers, ctx.device.type)
    if parallel.enable_chunk_batch:  # MindSpeed's ChunkMBS: slices run inside one FSDP unshard (chunk_batch.py)
        from fsdp2_backend.parallel.chunk_batch import apply_chunk_batch

        apply_chunk_batch(model, parallel)
    if config.optimization.torch_compile:  # each decoder block once, around what the stages above installed
        from fsdp2_backend.parallel.compile import apply_compile

        apply_compile(model)
    model = apply_fsdp(model, parallel, ctx.fsdp_mesh, extra_ignored=fsdp_ignored)
    if quantized:
        from fsdp2_backend.parallel.quantize import finish_after_fsdp

        finish_after_fsdp(model, recompute=parallel.recompute)
    set_gradient_policy(model)
    return model
