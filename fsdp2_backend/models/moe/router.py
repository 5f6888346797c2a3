"""The top-k MoE router with Megatron's routing options, as plain model code.

Megatron-core's router (`megatron.core.transformer.moe.router.TopKRouter`, `moe_utils`) is tied to its
process-group globals and CUDA, so it cannot run inside an HF model here; this module re-states its maths
(tests compare every function with megatron-core 0.16.1 on the same logits; the pure functions are in
`router_functions.py`):

- scores: `softmax` (top-k on the logits then softmax over the k — renormalised; or `pre_softmax`: softmax over
  all experts then top-k) or `sigmoid` (top-k of sigmoid scores, optionally selected on `scores + expert_bias`,
  renormalised when k > 1), or MindSpeed's `sqrtsoftplus` (sqrt(softplus(logits)), routed as sigmoid);
  group-limited top-k (`num_groups` / `group_topk`; a group scored by its top (k / group_topk) scores, or by the
  model's own count, `group_score_topk`, until Megatron's group flags ask for Megatron's); a `scaling_factor`;
- load balancing: `aux_loss` (per micro-batch), `seq_aux_loss` (per sequence), `global_aux_loss` (token counts
  of the whole global batch), `sinkhorn`, `none`; the router `z_loss`; `mindspeed_seq_aux_loss`, MindSpeed's
  `--seq-aux` under balancing 'none' (DeepSeek-V3's sequence-wise loss: per sequence, the scores shifted by the
  selection bias and normalised, the counts of the experts actually selected; logged as `load_balancing_loss`);
- aux-loss-free balancing: `expert_bias`, a persistent buffer (saved in checkpoints), moved by
  `bias_update_rate` × sign(mean load − load) after every step from the global token counts
  (`finish_router_step`, as megatron-core's `finalize_model_grads` does).

Sums over other ranks are functions the plan hands each router (`RouterReductions`, set by
`parallel/router_groups.py`): model code sees no process group; without a plan every sum is this rank's own.

The HF model types route the same way with their own defaults (`RouterSettings.from_hf`): Qwen3-MoE is softmax
(pre-softmax unless `norm_topk_prob`), MiniMax-M2 and Step-3.5 sigmoid with a correction bias, gpt_oss softmax
over the top-k of biased logits.

Losses: with `settings.megatron_losses` the router computes Megatron's losses in training, keeps the weighted
sum (with its graph) in `pending_loss` for the model to return as `aux_loss`, and the unweighted values per name
for the log line (`load_balancing_loss`, `seq_load_balancing_loss`, `global_load_balancing_loss`, `z_loss`),
read and cleared by `finish_router_step`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from fsdp2_backend.models.moe.routing import balanced_assignment
from fsdp2_backend.models.moe.router_functions import (aux_loss_scores, mindspeed_seq_aux_scores, sinkhorn_routing,
                                                       switch_load_balancing_loss, topk_routing, updated_expert_bias,
                                                       z_loss)

LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss",
              "mindspeed_seq_aux_loss": "load_balancing_loss"}  # MindSpeed logs its --seq-aux loss so
_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class RouterSettings:
    """How one router scores and selects experts, and which Megatron losses it adds."""

    num_experts: int
    top_k: int
    score_function: str = "softmax"
    pre_softmax: bool = False
    num_groups: Optional[int] = None
    group_topk: Optional[int] = None
    group_score_topk: Optional[int] = None  # a group's score: the sum of its top this many; None: k / group_topk
    scaling_factor: Optional[float] = None
    load_balancing: Tuple[Tuple[str, float], ...] = ()  # (type, coeff): Megatron's losses, in its order
    z_loss_coeff: Optional[float] = None
    sinkhorn: bool = False
    expert_bias: bool = False
    bias_update_rate: float = 1e-3
    dtype: Optional[str] = None  # None: the input's dtype; "fp32" / "fp64"
    megatron_losses: bool = False  # Megatron's losses replace the HF model's own aux loss

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "RouterSettings":
        """The HF model type's own routing (Qwen3-MoE style: softmax; `norm_topk_prob` False = pre-softmax),
        then the Megatron router fields a checkpoint's config recorded (`moe_router`, see `record_fields`)."""
        num_experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts")
        settings = cls(num_experts=num_experts, top_k=hf_config.num_experts_per_tok,
                       pre_softmax=not getattr(hf_config, "norm_topk_prob", True))
        settings = replace(settings, **overrides)
        recorded = getattr(hf_config, ROUTER_CONFIG_KEY, None)
        return settings.with_model_fields(_Fields(recorded)) if recorded else settings

    def with_model_fields(self, model_args) -> "RouterSettings":
        """These settings overridden by the config's `model.moe_*` fields (unset fields keep the model's own)."""
        m, changes = model_args, {}
        for field, attr in (("moe_router_score_function", "score_function"), ("moe_router_pre_softmax", "pre_softmax"),
                            ("moe_router_num_groups", "num_groups"), ("moe_router_group_topk", "group_topk"),
                            ("moe_router_topk_scaling_factor", "scaling_factor"), ("moe_router_dtype", "dtype"),
                            ("moe_z_loss_coeff", "z_loss_coeff")):
            if getattr(m, field, None) is not None:
                changes[attr] = getattr(m, field)
        if any(getattr(m, f, None) is not None for f in ("moe_router_num_groups", "moe_router_group_topk")):
            changes["group_score_topk"] = None  # Megatron's flags ask for Megatron's group score, top (k / groups)
        if getattr(m, "moe_router_enable_expert_bias", False):
            changes.update(expert_bias=True, bias_update_rate=m.moe_router_bias_update_rate)
        kinds = getattr(m, "moe_router_load_balancing_type", None)
        if kinds is not None:
            kinds = [kinds] if isinstance(kinds, str) else list(kinds)
            coeffs = m.moe_aux_loss_coeff
            coeffs = list(coeffs) if isinstance(coeffs, (list, tuple)) else [coeffs] * len(kinds)
            changes.update(megatron_losses=True, sinkhorn="sinkhorn" in kinds,
                           load_balancing=tuple((k, float(c)) for k, c in zip(kinds, coeffs) if k in LOSS_NAMES))
        elif changes.get("z_loss_coeff"):
            changes["megatron_losses"] = True
        return replace(self, **changes)


ROUTER_CONFIG_KEY = "moe_router"  # the HF config key a run's Megatron router fields are recorded under
_FIELD_DEFAULTS = {"moe_router_enable_expert_bias": False, "moe_router_bias_update_rate": 1e-3,
                   "moe_aux_loss_coeff": 0.0}


class _Fields:
    """Model-argument look-alike over a recorded dict of `moe_*` fields (absent ones unset)."""

    def __init__(self, values: Dict):
        self.__dict__.update(values)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _FIELD_DEFAULTS.get(name)


def router_fields(model_args) -> Dict:
    """The `model.moe_router_*` / `moe_*_coeff` fields a run set (to record in the model's HF config, so that
    a checkpoint continues with the same router without the flags)."""
    names = ("moe_router_score_function", "moe_router_pre_softmax", "moe_router_topk_scaling_factor",
             "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
             "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
             "moe_z_loss_coeff", "moe_router_dtype")
    values = {name: getattr(model_args, name, None) for name in names}
    return {k: v for k, v in values.items() if v is not None and v != _FIELD_DEFAULTS.get(k, None)}


def _this_rank(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class RouterReductions:
    """The cross-rank sums a router's losses and its step need, as functions (in place, returning the tensor) and
    the number of ranks each spans; the defaults are one rank's. Megatron's groups: `sum_sequence` over the ranks
    that split one sequence (its tp_cp group), `sum_batch` over those of a global batch (tp_dp_cp), `sum_all` over
    every rank (the expert-bias token counts). `tp_split`: of the sequence ranks, how many split it for tensor
    parallel, not context parallel (their gradients are summed, not averaged)."""

    sum_sequence: Callable[[torch.Tensor], torch.Tensor] = _this_rank
    sequence_ranks: int = 1
    sum_batch: Callable[[torch.Tensor], torch.Tensor] = _this_rank
    batch_ranks: int = 1
    sum_all: Callable[[torch.Tensor], torch.Tensor] = _this_rank
    tp_split: int = 1


# -- the module ------------------------------------------------------------------------------------------------
class TopKRouter(nn.Module):
    """Router logits `x @ weight.T (+ bias)` → (logits, top-k weights, top-k index), HF routers' return value.

    `settings` say how to route; `fixed` (fix_router) takes the experts from `balanced_assignment` (balanced
    load for performance tuning — different results) and weights them as the router would. `reductions`, set
    from outside (`parallel/router_groups.py`; default: this rank only): `sum_sequence` (cp ranks; Megatron's
    tp_cp, tp ranks here see the same tokens) sums `aux_loss` / `seq_aux_loss` token counts, `sum_batch`
    (dp x cp) `global_aux_loss`'s. A rank's loss is its share (own scores, group counts), weighted x cp as megatron-core
    scales aux losses, and logged so that the engine's mean over dp x cp is Megatron's logged value.
    Input of shape (B, S, H) lets `seq_aux_loss` tell the sequences apart; (T, H) is one sequence.
    """

    def __init__(self, settings: RouterSettings, hidden_size: int, bias: bool = False):
        nn.Module.__init__(self)  # not super(): model routers also derive from their HF router class
        self.settings = settings
        self.hidden_dim = hidden_size
        self.top_k, self.num_experts = settings.top_k, settings.num_experts
        self.weight = nn.Parameter(torch.zeros(settings.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(settings.num_experts)) if bias else None
        self.fixed = False
        self.reductions = RouterReductions()
        self.pending_loss: Optional[torch.Tensor] = None
        self.logged: Dict[str, torch.Tensor] = {}
        self.apply_settings(settings)

    def apply_settings(self, settings: RouterSettings) -> None:
        """Adopts `settings`, creating the buffers they need (expert bias and token counts) on the weight's
        device; an existing expert bias is kept."""
        self.settings = settings
        device = self.weight.device
        if settings.expert_bias and getattr(self, "expert_bias", None) is None:
            self.register_buffer("expert_bias", torch.zeros(settings.num_experts, device=device))
        if settings.expert_bias and getattr(self, "local_tokens_per_expert", None) is None:  # (a model's own bias
            self.register_buffer("local_tokens_per_expert", torch.zeros(settings.num_experts, device=device),
                                 persistent=False)                                   # may be the expert bias)
        if any(kind == "global_aux_loss" for kind, _ in settings.load_balancing):
            self.register_buffer("global_tokens_per_expert", torch.zeros(settings.num_experts, device=device),
                                 persistent=False)
            self.register_buffer("ga_steps", torch.zeros((), device=device), persistent=False)

    def reset_buffers(self) -> None:
        """Zeroes the routing buffers (their initialisation; the expert bias starts at 0 as in Megatron)."""
        for name in ("expert_bias", "local_tokens_per_expert", "global_tokens_per_expert", "ga_steps"):
            buf = getattr(self, name, None)
            if buf is not None:
                buf.zero_()

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = _DTYPES[self.settings.dtype] or hidden.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(hidden.to(dtype), self.weight.to(dtype), bias)

    def forward(self, hidden_states: torch.Tensor):
        batch = hidden_states.shape[0] if hidden_states.dim() == 3 else 1
        logits = self.gating(hidden_states.reshape(-1, self.hidden_dim))
        weights, index = self.route(logits, batch)
        return logits, weights, index

    def route(self, logits: torch.Tensor, batch: int = 1, selection_bias: Optional[torch.Tensor] = None
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(weights, index) for router logits (T, E) of `batch` sequences laid out one after the other; adds
        the Megatron losses and counts the expert load in training. `selection_bias` (sigmoid scores): a bias
        the model holds itself (e.g. MiniMax-M2's checkpoint `e_score_correction_bias`), used for selection in
        place of Megatron's expert bias and never updated here."""
        s = self.settings
        training = self.training and torch.is_grad_enabled()
        self.pending_loss = None
        if training and s.megatron_losses and s.z_loss_coeff:
            # a mean over this rank's tokens: tp ranks' gradients are summed, so 1/tp makes it the whole mean
            self._add_loss("z_loss", z_loss(logits, s.z_loss_coeff), s.z_loss_coeff,
                           scale=1 / self.reductions.tp_split)
        bias = getattr(self, "expert_bias", None) if s.expert_bias else None
        if selection_bias is not None:
            bias = selection_bias.to(logits.dtype)
        index = balanced_assignment(logits.shape[0], s.top_k, s.num_experts, logits.device) if self.fixed else None
        if s.sinkhorn and index is None:
            weights, index = sinkhorn_routing(logits, s.top_k, self.training)
        else:
            weights, index = topk_routing(logits, s, bias, index)
        if training and s.megatron_losses and s.load_balancing:
            self._load_balancing_losses(logits, batch, bias, index)
        if training and s.expert_bias and bias is not None:
            with torch.no_grad():  # the load seen this step, for the bias update after it
                self.local_tokens_per_expert += torch.bincount(index.reshape(-1), minlength=s.num_experts)
        return weights, index

    def _load_balancing_losses(self, logits: torch.Tensor, batch: int, bias: Optional[torch.Tensor],
                               index: torch.Tensor) -> None:
        s = self.settings
        routing_map, scores = aux_loss_scores(logits, s.top_k, s.score_function)
        if any(kind == "mindspeed_seq_aux_loss" for kind, _ in s.load_balancing):
            if self.fixed:  # MindSpeed counts the router's own choice (fix_router replaces it afterwards)
                with torch.no_grad():
                    index = topk_routing(logits, s, bias)[1]
            selected = torch.zeros_like(routing_map).scatter(1, index, True)
            biased_scores = mindspeed_seq_aux_scores(logits, s.score_function, bias)
        tokens, r = logits.shape[0], self.reductions
        cp = r.sequence_ranks
        for kind, coeff in s.load_balancing:
            if coeff <= 0:
                continue
            log_scale = cp
            if kind == "aux_loss":
                counts = r.sum_sequence(_counts(routing_map.sum(0)))
                loss = switch_load_balancing_loss(scores, counts, tokens * cp, s.top_k, s.num_experts, coeff)
            elif kind.endswith("seq_aux_loss"):  # per sequence: (B, S, E) → (S, B·E), Megatron's [s, b] layout
                seq = tokens // batch
                per_seq = lambda t: t.view(batch, seq, -1).transpose(0, 1).reshape(seq, -1)  # noqa: E731
                kind_map, kind_scores = (routing_map, scores) if kind == "seq_aux_loss" else (selected, biased_scores)
                counts = r.sum_sequence(_counts(per_seq(kind_map).sum(0)))
                loss = switch_load_balancing_loss(per_seq(kind_scores), counts, seq * cp, s.top_k, s.num_experts,
                                                  coeff) / batch
            else:  # global_aux_loss: the global batch's token counts, averaged over its micro-batches so far
                counts = r.sum_batch(_counts(routing_map.sum(0)))
                log_scale = r.batch_ranks  # Megatron logs the sum over dp x cp, not a dp mean
                with torch.no_grad():
                    self.global_tokens_per_expert += counts
                    self.ga_steps += 1
                loss = switch_load_balancing_loss(scores, self.global_tokens_per_expert / self.ga_steps,
                                                  tokens * log_scale, s.top_k, s.num_experts, coeff)
            self._add_loss(LOSS_NAMES[kind], loss, coeff, scale=cp // r.tp_split, log_scale=log_scale)

    def _add_loss(self, name: str, weighted: torch.Tensor, coeff: float, scale: int = 1,
                  log_scale: int = 1) -> None:
        value = (weighted / coeff).detach().float() * log_scale
        weighted = weighted * scale
        self.pending_loss = weighted if self.pending_loss is None else self.pending_loss + weighted
        self.logged[name] = self.logged[name] + value if name in self.logged else value

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, {self.settings.score_function}"


def _counts(counts: torch.Tensor) -> torch.Tensor:
    """Token counts without gradient, in fp32 (what the ranks sum)."""
    return counts.detach().float()


def routers(model: nn.Module) -> Iterator[TopKRouter]:
    yield from (m for m in model.modules() if isinstance(m, TopKRouter))


def collect_aux_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The sum of the routers' weighted Megatron losses of the last forward (None when none), taken once."""
    total = None
    for router in routers(model):
        if router.pending_loss is not None:
            total = router.pending_loss if total is None else total + router.pending_loss
            router.pending_loss = None
    return total


def attach_aux_loss(model: nn.Module, out):
    """`out` (a transformers causal-LM output) with the routers' Megatron losses of this forward as `aux_loss`
    (added to `out.loss` when there is one); unchanged when the routers hold none."""
    aux = collect_aux_loss(model)
    if aux is not None:
        out.aux_loss = aux
        if out.loss is not None:
            out.loss = out.loss + aux
    return out


@torch.no_grad()
def finish_router_step(model: nn.Module, num_microbatches: int) -> Dict[str, float]:
    """After a training step: updates every expert bias from the token counts summed over all ranks (the sign
    of mean load − load does not change when tensor or context ranks count the same tokens twice), resets the
    step's counters, and returns Megatron's MoE log values (each loss summed over layers / number of MoE
    layers, averaged over micro-batches and over the ranks of a global batch: data-parallel x cp, and the tp
    ranks too where they routed different tokens, `parallel/moe_tensor_parallel.py`). The sums are the routers'
    `reductions` (the plan sets every router's alike)."""
    found = list(routers(model))
    if not found:
        return {}
    reductions = found[0].reductions
    biased = [r for r in found if getattr(r, "expert_bias", None) is not None]
    if biased:
        counts = reductions.sum_all(torch.stack([r.local_tokens_per_expert for r in biased]))
        new = updated_expert_bias(counts, torch.stack([r.expert_bias for r in biased]),
                                  biased[0].settings.bias_update_rate)
        for router, bias in zip(biased, new):
            router.expert_bias.copy_(bias)
            router.local_tokens_per_expert.zero_()
    for router in found:
        if getattr(router, "ga_steps", None) is not None:
            router.global_tokens_per_expert.zero_()
            router.ga_steps.zero_()
    names = list(dict.fromkeys(name for r in found for name in r.logged))  # megatron-core's order: z_loss first
    if not names:
        return {}
    values = torch.stack([sum(r.logged[n] for r in found if n in r.logged) for n in names]).float()
    values /= len(found) * num_microbatches
    if reductions.batch_ranks > 1:
        values = reductions.sum_batch(values)
        values /= reductions.batch_ranks
    for router in found:
        router.logged = {}
    return dict(zip(names, values.tolist()))
