"""Config rules of the fields MindSpeed-LLM's FSDP2 YAMLs gained after the seed's reference (commit c77308a1):
what each does here, as errors, notices (no effect here, said once) and the normalisation of its aliases.
Torch-free; called from `validation`.

- Honoured: `training.deterministic` (build.seed_everything), `training.optimizer: fused_adamw` (AdamW with torch's
  fused kernel), `training.router_aux_loss_coef` (the MoE config's own coefficient, build.build_model),
  `training.mtp_loss_scaling_factor` (alias of model.mtp_loss_scaling_factor), ChunkMBS
  (`parallel.enable_chunk_batch` and `chunk_mbs*`: parallel/chunk_batch.py), `parallel.cp_type: kvallgather` (the
  same exact attention as ring: runs as ring; for deepseek_v4 and glm52 MindSpeed's own way, parallel/
  context_parallel/dsa_deepseek_v4.py, dsa_glm.py).
- No effect here, said once: `parallel.fsdp_implementation: custom` / `hook_modules` (MindSpeed's own Ascend FSDP;
  torch's FSDP2 gives the same results), the NPU-only fused ops (`use_sparse_flash_attn`,
  `use_fused_lightning_indexer(_loss)`, `use_ascend_mhc`, `use_triton_swiglu_limit`) and the windows only the NPU
  indexer-loss op reads (`pre_tokens`, `next_tokens`). `training.indexer_loss_coeff` is honoured: the DSA indexer's
  KL loss (models/dsa_indexer_loss.py); its v26.1.0 spelling `optimization.indexer_loss_coeff` too
  (mindspeed_release_rules).
- MindSpeed's own refusals are kept: the DSA fusions name DSA models only, mHC and SwiGLU-limit DeepSeek-V4 only.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List

from fsdp2_backend.config.schema import ModelArguments, OptimizationArguments, ParallelArguments
from fsdp2_backend.models.registry import spec_of, specs

_KVALLGATHER_AS_RING = ("parallel.cp_type: kvallgather runs as ring here — the same exact attention (each rank's "
                        "queries over every key/value), exchanged in a ring")
_NPU_ONLY = {
    "use_sparse_flash_attn": "NPU sparse flash attention (torch_npu); DSA attention runs in torch ops here",
    "use_fused_lightning_indexer": "NPU lightning-indexer kernel (torch_npu); the DSA top-k runs in torch ops here",
    "use_fused_lightning_indexer_loss": "NPU fused indexer KL-loss kernel (torch_npu); the indexer KL loss "
                                        "(training.indexer_loss_coeff) runs in torch ops here",
    "use_ascend_mhc": "Ascend fused mHC operators (cann_ops_transformer); mHC runs in torch ops here",
    "use_triton_swiglu_limit": "Triton-Ascend SwiGLU-with-limit kernel (NPU); the clamped SwiGLU runs in torch ops "
                               "here",
}


def head_field_errors(config) -> List[str]:
    """Every problem of these fields (MindSpeed's own rules included)."""
    p, t, o, m = config.parallel, config.training, config.optimization, config.model
    errors: List[str] = []
    if p.chunk_mbs < 1:
        errors.append(f"parallel.chunk_mbs: must be at least 1 (samples per slice), got {p.chunk_mbs}")
    if p.chunk_mbs_batch_dim < 0 or any(i < 0 for i in p.chunk_mbs_arg_indexs):
        errors.append("parallel.chunk_mbs_batch_dim / chunk_mbs_arg_indexs: must be >= 0 — give the batch "
                      "dimension (0) and the positional arguments to slice ([0])")
    if p.enable_chunk_batch and not p.chunk_mbs_modules:
        errors.append("parallel.chunk_mbs_modules: empty with enable_chunk_batch — name the modules to run slice by "
                      "slice (model.layers.{*})")
    balancing = m.moe_router_load_balancing_type
    if p.enable_chunk_batch and balancing not in (None, "none", ["none"]):
        errors.append("parallel.enable_chunk_batch: Megatron's load-balancing losses (model.moe_router_load_balancing_"
                      "type) are computed per call, so per slice they are not the micro-batch's — drop one of them")
    if t.optimizer == "fused_adamw" and t.o2_optimizer:
        errors.append("training.optimizer: fused_adamw and training.o2_optimizer (bf16 moments) are two different "
                      "AdamW kernels — choose one")
    if t.indexer_loss_coeff is not None and t.indexer_loss_coeff < 0:
        errors.append(f"training.indexer_loss_coeff: must be >= 0 (0 leaves the DSA indexer untrained), got "
                      f"{t.indexer_loss_coeff}")
    if t.router_aux_loss_coef is not None and t.router_aux_loss_coef < 0:
        errors.append(f"training.router_aux_loss_coef: must be >= 0, got {t.router_aux_loss_coef}")
    default_mtp = ModelArguments().mtp_loss_scaling_factor
    if t.mtp_loss_scaling_factor is not None and m.mtp_loss_scaling_factor not in (default_mtp,
                                                                                   t.mtp_loss_scaling_factor):
        errors.append(f"training.mtp_loss_scaling_factor: {t.mtp_loss_scaling_factor} and model.mtp_loss_scaling_"
                      f"factor {m.mtp_loss_scaling_factor} name the same weight — give one")
    spec = spec_of(m.model_id)
    dsa_ids = [s.model_id for s in specs() if s.dsa]  # MindSpeed: dsv32 / deepseek_v4 / glm5*
    dsa = [name for name in ("use_sparse_flash_attn", "use_fused_lightning_indexer",
                             "use_fused_lightning_indexer_loss") if getattr(o, name)]
    if dsa and not (spec and spec.dsa):
        errors.append(f"optimization.{dsa[0]}: for DSA models only (model_id {' / '.join(dsa_ids)}; "
                      f"MindSpeed's rule), got model_id {m.model_id} — drop it")
    from fsdp2_backend.config.rules.model import megatron_router_set

    if spec and spec.router == "own" and megatron_router_set(m):
        errors.append(spec.note("router"))
    mhc_ids = " / ".join(s.model_id for s in specs() if s.mindspeed_mhc)
    for name in ("use_ascend_mhc", "use_triton_swiglu_limit"):
        if getattr(o, name) and not (spec and spec.mindspeed_mhc):
            errors.append(f"optimization.{name}: for model_id {mhc_ids} only (MindSpeed's rule), got model_id "
                          f"{m.model_id} — drop it")
    return errors


def head_field_notices(config) -> List[str]:
    """The fields set that have no effect here, each said once."""
    p, t, o = config.parallel, config.training, config.optimization
    notices: List[str] = []
    if p.fsdp_implementation == "custom":
        notices.append("parallel.fsdp_implementation: custom (MindSpeed's own Ascend FSDP) runs as native here — "
                       "torch's FSDP2 shards the same fsdp_modules, with the same results")
    if p.hook_modules != ParallelArguments().hook_modules:
        notices.append("parallel.hook_modules: no effect — only MindSpeed's custom FSDP implementation reads it")
    if p.ep_dispatcher == "mc2" and p.ep_size == 1:  # MindSpeed's DeepSeek-V4 example: mc2 with EP off
        notices.append("parallel.ep_dispatcher: mc2 (an Ascend MC2 kernel) has no effect with ep_size 1 — no tokens "
                       "are dispatched")
    if p.cp_type == "kvallgather":
        spec = spec_of(config.model.model_id)  # the DSA ids: MindSpeed's kvallgather itself (the spec's cp_hook)
        notices.append(spec.note("kvallgather") if spec and "kvallgather" in spec.notes else _KVALLGATHER_AS_RING)
    if not p.enable_chunk_batch:
        defaults = ParallelArguments()
        notices += [f"parallel.{name}: no effect without parallel.enable_chunk_batch"
                    for name in ("chunk_mbs", "chunk_mbs_batch_dim", "chunk_mbs_modules", "chunk_mbs_arg_indexs",
                                 "chunk_mbs_kwarg_names") if getattr(p, name) != getattr(defaults, name)]
    notices += [f"optimization.{name}: no effect — {why}" for name, why in _NPU_ONLY.items() if getattr(o, name)]
    defaults_o = OptimizationArguments()
    for name in ("pre_tokens", "next_tokens"):
        if getattr(o, name) != getattr(defaults_o, name):
            notices.append(f"optimization.{name}: no effect — only MindSpeed's NPU fused indexer KL loss "
                           f"(use_fused_lightning_indexer_loss) reads it")
    return notices


def normalise_head_fields(config):
    """The aliases resolved: training.mtp_loss_scaling_factor → model.mtp_loss_scaling_factor, cp_type kvallgather →
    ring."""
    t = config.training
    if config.parallel.cp_type == "kvallgather":
        config = replace(config, parallel=replace(config.parallel, cp_type="ring"))
    if t.mtp_loss_scaling_factor is not None:
        config = replace(config, model=replace(config.model, mtp_loss_scaling_factor=t.mtp_loss_scaling_factor))
    return config
