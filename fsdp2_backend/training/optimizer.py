"""Optimizers: AdamW with Megatron's weight-decay groups, and Muon (+ AdamW for the rest), over FSDP2 params.

Owns `build_optimizer` (the one entry point), `CombinedOptimizer` (steps / zero_grads / state_dicts several
torch optimizers as one) and `ShardedMuon`.

Weight decay (Megatron's default rule): no decay for 1-D parameters and names ending in `.bias`, except the
QK-norm weights when `apply_wd_to_qk_layernorm` (Megatron's --apply-wd-to-qk-layernorm). Every param group
carries `wd_mult` (1.0 or 0.0); the scheduler writes `weight_decay = schedule × wd_mult`.

Decoupled learning rate (Megatron's --decoupled-lr / --decoupled-min-lr): the input embedding and output layer
weights (Megatron's `is_embedding_or_output_parameter`) go to their own groups carrying `max_lr` (and `min_lr`
when given); the scheduler reads a group's `max_lr` / `min_lr` before its own, as Megatron's does. Groups on
the default schedule come first, so `param_groups[0]["lr"]` is the lr Megatron logs.

Muon: `torch.optim.Muon` for the 2-D matrices inside the transformer layers; AdamW for embeddings, lm_head,
norms, biases and anything not 2-D (3-D grouped expert weights included, for now). What torch.optim.Muon does
with an FSDP2 DTensor: its Newton-Schulz iteration runs through DTensor ops on the Shard(0) gradient, which
computes the right matrix only up to bf16 rounding that depends on the sharding (measured here: 5% max
difference for a tall 24×16 matrix on 2 ranks) and issues implicit collectives inside every iteration. So
`ShardedMuon` (a torch.optim.Muon subclass: same param groups, defaults, state keys and update rule) gathers
each matrix's momentum-blended update once (`full_tensor`), orthogonalises the whole matrix with torch's own
Newton-Schulz function, and keeps its local shard: every rank computes the same result as a 1-rank run, at
the cost of one all-gather per matrix per step and redundant Newton-Schulz compute on every rank.
"""
from __future__ import annotations

from typing import Any, Container, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz  # torch's Muon math, reused as is

from fsdp2_backend.training.param_steps import momentum_update, on_full_matrix, params_with_grad, run_closure
from fsdp2_backend.usage_errors import UsageError


# Module names of QK-norm layers: HF (Qwen3, Qwen3-Next, ...) and Megatron spellings.
QK_NORM_MODULES = ("q_norm", "k_norm", "q_layernorm", "k_layernorm")


def is_qk_norm(name: str) -> bool:
    """Whether `name` is a parameter of a QK-norm layer (e.g. `model.layers.0.self_attn.q_norm.weight`)."""
    return any(part in QK_NORM_MODULES for part in name.split(".")[:-1])


def no_weight_decay(name: str, param: torch.Tensor, apply_wd_to_qk_layernorm: bool = False) -> bool:
    """Megatron's default exclusion: biases and every 1-D parameter (norm weights) get no weight decay; with
    `apply_wd_to_qk_layernorm`, QK-norm parameters are decayed all the same (Megatron's Qwen3-Next rule)."""
    if apply_wd_to_qk_layernorm and is_qk_norm(name):
        return False
    return name.endswith(".bias") or param.dim() == 1


def _embedding_modules(model: nn.Module) -> List[nn.Module]:
    """The input embedding and output layer (HF's getters), whatever their names; tied heads appear once."""
    modules: List[nn.Module] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None and all(module is not m for m in modules):
            modules.append(module)
    return modules


def embedding_or_output_params(model: nn.Module) -> set:
    """ids of Megatron's `is_embedding_or_output_parameter`s: the input embedding's and output layer's weights."""
    return {id(m.weight) for m in _embedding_modules(model) if getattr(m, "weight", None) is not None}


def adamw_param_groups(named_params: Iterable[Tuple[str, nn.Parameter]], *, decoupled: Container[int] = (),
                       decoupled_lr: Optional[float] = None, decoupled_min_lr: Optional[float] = None,
                       apply_wd_to_qk_layernorm: bool = False, mup: Container[int] = (),
                       mup_override: Optional[Dict[str, float]] = None) -> List[Dict[str, Any]]:
    """Megatron's param groups: [decay, no-decay] on the default schedule, then the same two for the params whose
    id is in `decoupled` carrying `max_lr` = decoupled_lr (and `min_lr` = decoupled_min_lr when given) — only
    when decoupled_lr is set — then (µP, `mup_override` given) the params whose id is in `mup` carrying its
    `max_lr` / `min_lr` / `eps`. Empty groups are dropped; each group has `wd_mult` for the scheduler."""
    override: Dict[str, float] = {}
    if decoupled_lr is not None:
        override["max_lr"] = decoupled_lr
        if decoupled_min_lr is not None:
            override["min_lr"] = decoupled_min_lr
    buckets: Dict[Tuple[int, float], List[nn.Parameter]] = {
        (own, wd_mult): [] for own in (0, 1, 2) for wd_mult in (1.0, 0.0)}
    for name, p in named_params:
        if p.requires_grad:
            wd_mult = 0.0 if no_weight_decay(name, p, apply_wd_to_qk_layernorm) else 1.0
            own = 1 if override and id(p) in decoupled else 2 if mup_override and id(p) in mup else 0
            buckets[(own, wd_mult)].append(p)
    overrides = {0: {}, 1: override, 2: mup_override or {}}
    groups = [{"params": params, "wd_mult": wd_mult, **overrides[own]} for (own, wd_mult), params in buckets.items()]
    return [g for g in groups if g["params"]]


def muon_param_names(model: nn.Module) -> List[str]:
    """Names of the parameters Muon trains: 2-D weights outside embeddings and the output layer.

    Embedding modules (every nn.Embedding, and HF's get_input_embeddings / get_output_embeddings) are
    excluded by module, so tied or renamed heads are caught whatever their names. Other 2-D weights (an MoE
    router's gate included) go to Muon; 3-D grouped expert weights stay with AdamW.
    """
    excluded = set()
    heads = [m for m in model.modules() if isinstance(m, nn.Embedding)] + _embedding_modules(model)
    for module in heads:
        excluded.update(id(p) for p in module.parameters())
    return [n for n, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and id(p) not in excluded]


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisation sees the full matrix when parameters are DTensors."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        for group, p, state in params_with_grad(self):
            lr = group["lr"]
            update = momentum_update(p, state, group["momentum"], group["nesterov"])
            args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
            update = on_full_matrix(update, lambda matrix: _zeropower_via_newtonschulz(matrix, *args))
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class CombinedOptimizer:
    """Several torch optimizers driven as one: `step`, `zero_grad`, `param_groups`, `state_dict`.

    It iterates over its torch optimizers, so DCP takes it as is: `torch.distributed.checkpoint.state_dict.
    get_state_dict(model, combined)` / `set_state_dict(model, combined, ...)` (they accept an iterable of
    optimizers; the flattened state covers all of them). `param_groups` is the concatenation (the same
    dicts), so the scheduler sets every group's lr.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        return {type(opt).__name__: opt.state_dict() for opt in self.optimizers}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for opt in self.optimizers:
            opt.load_state_dict(state[type(opt).__name__])


def build_optimizer(model: nn.Module, *, name: str = "adamw", lr: float, weight_decay: float,
                    betas: Tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, muon_momentum: float = 0.95,
                    muon_adjust_lr_fn: str = "match_rms_adamw", decoupled_lr: Optional[float] = None,
                    decoupled_min_lr: Optional[float] = None,
                    apply_wd_to_qk_layernorm: bool = False, o2: bool = False,
                    megatron_muon: Optional[Dict[str, Any]] = None, mup_width_mult: Optional[float] = None,
                    min_lr: float = 0.0) -> CombinedOptimizer:
    """AdamW (`name="adamw"`; "fused_adamw": torch's fused kernel) or Muon + AdamW (`name="muon"`) over `model`'s trainable parameters.

    Build it after FSDP sharding (the optimizers hold the DTensor parameters). From TrainingArguments:
    `build_optimizer(model, name=t.optimizer, lr=t.lr, weight_decay=t.weight_decay,
    betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, decoupled_lr=t.decoupled_lr,
    decoupled_min_lr=t.decoupled_min_lr, apply_wd_to_qk_layernorm=t.apply_wd_to_qk_layernorm)`. Muon's default lr
    adjustment "match_rms_adamw" (Moonshot) scales its update to AdamW's RMS so the same lr and weight decay
    serve both. The embedding and output layer are never Muon's, so the decoupled lr always lands on AdamW groups.
    `o2` (MindSpeed's --o2-optimizer): the AdamW moments are kept in bf16 (o2_adamw.BF16StateAdamW).
    `megatron_muon` (keyword arguments of muon.MegatronMuon: scale_mode, nesterov, ...): Megatron's Muon for the
    matrices instead of torch.optim.Muon.
    `mup_width_mult` m (Megatron's µP, models/mup.py; AdamW only): the matrices outside the embeddings and output
    layer get lr / m, min_lr / m and eps / m (megatron-core's get_mup_config_overrides); m = 1 changes nothing.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    group_options = dict(decoupled=embedding_or_output_params(model), decoupled_lr=decoupled_lr,
                         decoupled_min_lr=decoupled_min_lr, apply_wd_to_qk_layernorm=apply_wd_to_qk_layernorm)
    if mup_width_mult is not None and mup_width_mult != 1.0:
        from fsdp2_backend.models.mup import hidden_matrix_names

        hidden = set(hidden_matrix_names(model))
        group_options.update(mup={id(p) for n, p in named if n in hidden}, mup_override=dict(
            max_lr=lr / mup_width_mult, min_lr=min_lr / mup_width_mult, eps=eps / mup_width_mult))
    if name in ("adamw", "fused_adamw"):
        fused = name == "fused_adamw" and _fused_adamw_available(named)
        return CombinedOptimizer([_adamw(named, lr, weight_decay, betas, eps, group_options, o2, fused)])
    if name != "muon":
        raise UsageError(f"optimizer: unknown optimizer {name!r} — use adamw or muon")
    muon_names = set(muon_param_names(model))
    matrices = [p for n, p in named if n in muon_names]
    rest = [(n, p) for n, p in named if n not in muon_names]
    optimizers: List[torch.optim.Optimizer] = []
    if matrices and megatron_muon is not None:
        from fsdp2_backend.training.muon import MegatronMuon

        optimizers.append(MegatronMuon([{"params": matrices, "wd_mult": 1.0}], lr=lr, weight_decay=weight_decay,
                                       momentum=muon_momentum, **megatron_muon))
    elif matrices:
        optimizers.append(ShardedMuon([{"params": matrices, "wd_mult": 1.0}], lr=lr, weight_decay=weight_decay,
                                      momentum=muon_momentum, adjust_lr_fn=muon_adjust_lr_fn))
    if rest:
        optimizers.append(_adamw(rest, lr, weight_decay, betas, eps, group_options, o2))
    return CombinedOptimizer(optimizers)


def _fused_adamw_available(named) -> bool:
    """MindSpeed's `optimizer: fused_adamw`: torch's fused AdamW kernel (the same update) where the parameters'
    device has one; elsewhere the standard AdamW, said once."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = {p.device.type for _, p in named}
    missing = sorted(devices - set(_get_fused_kernels_supported_devices()))
    if missing:
        from fsdp2_backend.distributed.console import print_rank0

        print_rank0(f"training.optimizer: fused_adamw has no fused kernel on {', '.join(missing)} here — the "
                    f"standard AdamW runs (the same update)")
    return not missing


def _adamw(named, lr, weight_decay, betas, eps, group_options, o2=False, fused=False) -> torch.optim.AdamW:
    if o2:
        from fsdp2_backend.training.o2_adamw import BF16StateAdamW

        return BF16StateAdamW(adamw_param_groups(named, **group_options), lr=lr, weight_decay=weight_decay,
                              betas=betas, eps=eps)
    groups = adamw_param_groups(named, **group_options)
    if fused:  # the fused kernel takes one tensor kind per call: FSDP's DTensors apart from ignored plain tensors
        from torch.distributed.tensor import DTensor

        groups = [{**group, "params": [p for p in group["params"] if isinstance(p, DTensor) == dtensor]}
                  for group in groups for dtensor in (True, False)]
        groups = [group for group in groups if group["params"]]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused or None)
