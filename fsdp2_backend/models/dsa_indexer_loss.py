"""The DSA lightning indexer's KL loss (MindSpeed-LLM's `training.indexer_loss_coeff`), for the `deepseek_v4` and
`glm52` model ids: the indexer is trained to predict where the main attention looks.

Contract (`indexer_kl_loss`), per compressed-sparse-attention (CSA) layer and micro-batch, for a batch of B
sequences of S queries, the indexer's selected compressed keys K(b, s) (its top-k, causal entries only; -1 = none):
- target p(j), j in K(b, s): the main attention's probabilities over the selected keys, per head
  softmax_j(scale · q_h · c_j) (q: the attention's roped query, c: the compressed KV, both detached; no sinks, no
  sliding-window keys), summed over the H heads and L1-normalised (MindSpeed's `compute_dsa_indexer_loss`, as
  Megatron-LM's DSA: sum over heads, not mean — the same after normalising);
- prediction r(j) = softmax_j(index score of j) over the same selected keys (top-k restricted, not dense);
- loss = coeff · Σ_{b,s} KL(p || r) / (B · S): every query weighs the same (MindSpeed's mean over b and s).
  A query with no selected key (position < compress rate − 1) contributes 0 (MindSpeed feeds such rows zeros and
  gets a constant without gradient; the constant is not added here).
Gradient: only through the index scores, and the indexer's inputs (hidden states, query residual) are detached
(Megatron-LM's DSA, DeepSeek-V3.2's separate indexer optimisation; MindSpeed's GLM-5.2 detaches them too): the loss
trains the indexer's parameters only; the rest of the model's gradients are those of the lm loss.

Backward scale (`set_backward_scale`): the trainer gives the loss the gradient its micro-batch's lm loss gets
(loss scale / (micro-batches x data-parallel ranks): Megatron's DSAIndexerLossAutoScaler scale; with one
micro-batch this is MindSpeed's FSDP2 scale of 1 averaged over data-parallel ranks). Reported as `indexer loss`
(MindSpeed's and Megatron's name, coefficient included): the mean over CSA layers and micro-batches, averaged over
data-parallel ranks (`finish_indexer_step`, with the sum over ranks the plan hands it: parallel/loss_hooks.py; model
code sees no process group).
DeepSeek-V4 under context parallel (parallel/context_parallel/dsa_deepseek_v4.py): the hooks see this rank's
queries, index scores and top-k and the whole sequence's compressed keys, so each rank's loss is the mean over its
own B · S/cp queries; the ranks hold equally many, so the trainer's scale (over micro-batches x dp x cp ranks, the
gradients summed over them) and the log's average over that group give cp 1's gradient and value.

Model code stays plain: the loss is attached by forward hooks on transformers' modules (`install_deepseek_v4`,
`install_glm52`); active only in training with gradients enabled and coeff > 0. GLM-5.2 (transformers' glm_moe_dsa,
whose indexer runs under no_grad and returns indices only; MindSpeed computes this loss there in its NPU kernel):
the hooks recompute, outside no_grad, the index scores from the detached inputs (`glm_index_scores`, transformers'
indexer math) and, without gradient, the attention's query and per-head keys; layers sharing a previous layer's
top-k ("shared" indexer type) have no indexer and no loss. Under context parallel (`glm52`:
parallel/context_parallel/dsa_glm.py) the hooks score this rank's queries against every rank's keys, gathered into
sequence order (the top-k are global key positions), and each rank's loss is the mean over its own B · S/cp queries:
the ranks hold equally many queries, so the trainer's backward scale (over micro-batches x data-parallel x cp
ranks, the gradients summed over them) and the logged average over that group give cp 1's gradient and value.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_EPS = 1e-10
_TARGET_BLOCK = 1 << 25  # logits per block of the target's queries (128 MiB in fp32)
LOG_NAME = "indexer loss"


def indexer_kl_loss(index_scores: Tensor, topk_indices: Tensor, query: Tensor, key: Tensor, scale: float,
                    coeff: float) -> Tensor:
    """The contract above. index_scores (B, S, T) with grad; topk_indices (B, S, k), -1 = none; query
    (B, H, S, D); key (B, T, D) (one shared KV head, DeepSeek-V4) or (B, H, T, D) (per-head keys, GLM-5.2's MLA)."""
    b, h, s, _ = query.shape
    valid = topk_indices >= 0
    index = topk_indices.clamp(min=0).long()
    neg = torch.finfo(torch.float32).min
    with torch.no_grad():
        # the attention's logits over every key, a block of queries at a time: B·H·S·T at once would be GBs at
        # GLM-5.2's 64 heads and 4k tokens; each block holds at most _TARGET_BLOCK of them
        pattern = "bhsd,btd->bhst" if key.dim() == 3 else "bhsd,bhtd->bhst"
        key32 = key.detach().float()
        rows = max(1, _TARGET_BLOCK // max(1, b * h * key.shape[-2]))
        targets = []
        for start in range(0, s, rows):
            end = min(s, start + rows)
            logits = torch.einsum(pattern, query[:, :, start:end].detach().float(), key32) * scale
            block_index, block_valid = index[:, start:end], valid[:, start:end].unsqueeze(1)
            chosen = logits.gather(-1, block_index.unsqueeze(1).expand(b, h, end - start, index.shape[-1]))
            targets.append((F.softmax(chosen.masked_fill(~block_valid, neg), dim=-1) * block_valid).sum(dim=1))
        target = torch.cat(targets, dim=1)
        target = target / target.sum(dim=-1, keepdim=True).clamp_min(_EPS)
    log_pred = F.log_softmax(index_scores.float().gather(-1, index).masked_fill(~valid, neg), dim=-1)
    kl = torch.where(valid, target * (torch.log(target.clamp_min(_EPS)) - log_pred), torch.zeros_like(log_pred))
    return kl.sum() / (b * s) * coeff


class _IndexerLossState:
    """One CSA attention's hooks' shared state: this forward's captures, the step's logged sum and count."""

    def __init__(self, coeff: float):
        self.coeff, self.scale = coeff, 1.0
        self.active = False
        self.captured: Dict[str, object] = {}
        self.logged_sum: Optional[Tensor] = None
        self.logged_count = 0


def _states(model: nn.Module) -> List[_IndexerLossState]:
    """The attached losses' states, found once per model (the trainer asks twice a step: a walk of every module
    each time would cost a large model milliseconds per step, and most models have none)."""
    states = model.__dict__.get("_dsa_indexer_states")
    if states is None:
        states = [m._dsa_indexer_loss for m in model.modules() if "_dsa_indexer_loss" in m.__dict__]
        model.__dict__["_dsa_indexer_states"] = states
    return states


def install_deepseek_v4(model: nn.Module, coeff: float) -> int:
    """Hooks the loss into every CSA attention of a DeepSeek-V4 model (transformers' classes); returns how many."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4

    from fsdp2_backend.models.mtp import _AttachLoss

    installed = 0
    model.__dict__.pop("_dsa_indexer_states", None)  # found anew on the next step
    for attn in model.modules():
        if not (isinstance(attn, dv4.DeepseekV4Attention)
                and isinstance(attn.compressor, dv4.DeepseekV4CSACompressor)) or hasattr(attn, "_dsa_indexer_loss"):
            continue
        state = _IndexerLossState(coeff)
        attn._dsa_indexer_loss = state
        indexer = attn.compressor.indexer

        def start(module, args, kwargs, state=state):
            state.active = module.training and torch.is_grad_enabled() and state.coeff > 0
            state.captured = {"rope": kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)}

        def capture(name, detach):
            def hook(module, args, output, state=state):
                if state.active:
                    value = output[0] if isinstance(output, tuple) else output
                    state.captured[name] = value.detach() if detach else value
            return hook

        def detach_inputs(module, args, state=state):  # the loss reaches the indexer's own parameters only
            if state.active:
                return (args[0].detach(), args[1].detach(), *args[2:])
            return None

        def finish(module, args, kwargs, output, state=state):
            if not state.active:
                return None
            c = state.captured
            state.active, state.captured = False, {}
            cos, sin = c["rope"][module.rope_layer_type]
            query = dv4.apply_rotary_pos_emb(c["q"], cos, sin)  # the attention's roped query (B, H, S, D)
            loss = indexer_kl_loss(c["scores"], c["topk"], query, c["kv"].squeeze(1), module.scaling, state.coeff)
            detached = loss.detach().float()
            state.logged_sum = detached if state.logged_sum is None else state.logged_sum + detached
            state.logged_count += 1
            return (_AttachLoss.apply(output[0], loss, state.scale), *output[1:])

        attn.register_forward_pre_hook(start, with_kwargs=True)
        attn.q_b_norm.register_forward_hook(capture("q", True))
        attn.compressor.register_forward_hook(capture("kv", True))
        indexer.register_forward_pre_hook(detach_inputs)
        indexer.scorer.register_forward_hook(capture("scores", False))
        indexer.register_forward_hook(capture("topk", True))
        attn.register_forward_hook(finish, with_kwargs=True)
        installed += 1
    return installed


def set_backward_scale(model: nn.Module, scale: float) -> None:
    """The gradient each attached indexer loss receives in backward (the trainer's, per step)."""
    for state in _states(model):
        state.scale = scale


def has_indexer_loss(model: nn.Module) -> bool:
    """Whether an indexer loss is attached to `model` (`install_deepseek_v4` / `install_glm52`); the plan asks
    before its stages run, so the walk caches nothing."""
    return any("_dsa_indexer_loss" in m.__dict__ for m in model.modules())


def finish_indexer_step(model: nn.Module, sum_over_ranks: Optional[Callable[[Tensor], Tensor]] = None
                        ) -> Dict[str, float]:
    """{"indexer loss": mean over layers and micro-batches, averaged over the ranks `sum_over_ranks` sums over
    (the plan's function, in place; None: this rank alone)} and resets; {} without a loss."""
    states = [s for s in _states(model) if s.logged_count]
    if not states:
        return {}
    totals = torch.stack([sum(s.logged_sum for s in states),
                          torch.tensor(float(sum(s.logged_count for s in states)),
                                       device=states[0].logged_sum.device)])
    for state in states:
        state.logged_sum, state.logged_count = None, 0
    if sum_over_ranks is not None:
        totals = sum_over_ranks(totals)
    return {LOG_NAME: (totals[0] / totals[1]).item()}


# -- GLM-5.2 ------------------------------------------------------------------------------------------------------
def glm_index_scores(indexer: nn.Module, hidden: Tensor, q_resid: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' GlmMoeDsaIndexer scores (B, S, T) before the causal mask, with gradient: Σ_h w_h ·
    ReLU(q_h · k) · scale, interleaved RoPE on the first qk_rope_head_dim channels. Under context parallel
    (`parallel/context_parallel/dsa_glm.py`) S is this rank's queries and T the whole sequence's keys."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    b, s, _ = hidden.shape
    rope, rest = indexer.qk_rope_head_dim, indexer.head_dim - indexer.qk_rope_head_dim
    q_rot, q_pass = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim).split([rope, rest], dim=-1)
    k_rot, k_pass = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2).split([rope, rest], dim=-1)
    q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    cp = getattr(indexer, "context_parallel", None)  # context parallel: every cp rank's keys, in sequence order
    if cp is not None:
        k = cp.gather(k, dim=1)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * indexer.n_heads ** -0.5
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def _allowed(mask: Tensor, index: Tensor) -> Tensor:
    """Whether the (B, S, T) attention mask (bool, or additive: 0 allowed) allows each selected key."""
    picked = mask.gather(-1, index.long())
    return picked if picked.dtype == torch.bool else picked > torch.finfo(picked.dtype).min / 2


def install_glm52(model: nn.Module, coeff: float) -> int:
    """Hooks the loss into every GLM-5.2 attention with its own indexer; returns how many."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    from fsdp2_backend.models.mtp import _AttachLoss

    installed = 0
    model.__dict__.pop("_dsa_indexer_states", None)  # found anew on the next step
    for attn in model.modules():
        if not isinstance(attn, glm.GlmMoeDsaAttention) or attn.indexer is None or hasattr(attn, "_dsa_indexer_loss"):
            continue
        state = _IndexerLossState(coeff)
        attn._dsa_indexer_loss = state

        def start(module, args, kwargs, state=state):
            state.active = module.training and torch.is_grad_enabled() and state.coeff > 0
            state.captured = {}

        def indexed(module, args, kwargs, output, state=state):
            if state.active:
                hidden, q_resid, (cos, sin), mask = args[:4]
                with torch.enable_grad():  # the indexer's own parameters only: its inputs detached
                    state.captured["scores"] = glm_index_scores(module, hidden.detach(), q_resid.detach(), cos, sin)
                state.captured["topk"] = torch.where(_allowed(mask, output), output.long(), -1)
                state.captured["q_resid"] = q_resid.detach()

        def finish(module, args, kwargs, output, state=state):
            if not state.active or "topk" not in state.captured:
                state.active = False
                return None
            c = state.captured
            state.active, state.captured = False, {}
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            with torch.no_grad():  # the attention's query and keys, recomputed as transformers' forward does
                b, s, _ = hidden.shape
                q = module.q_b_proj(c["q_resid"]).view(b, s, -1, module.qk_head_dim).transpose(1, 2)
                q_pass, q_rot = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
                kv_pass, k_rot = module.kv_a_proj_with_mqa(hidden).split([module.kv_lora_rank,
                                                                         module.qk_rope_head_dim], dim=-1)
                k_pass = module.kv_a_layernorm(kv_pass).view(b, 1, s, module.kv_lora_rank)
                q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(
                    q_rot, k_rot.view(b, 1, s, module.qk_rope_head_dim), cos, sin)
                cp = getattr(module, "context_parallel", None)  # context parallel: every cp rank's keys
                if cp is not None:
                    k_pass, k_rot = cp.gather(torch.cat([k_pass, k_rot], dim=-1), dim=2).split(
                        [module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
                key, _ = module.expand_kv(k_pass, k_rot)
                query = torch.cat([q_pass, q_rot], dim=-1)
            loss = indexer_kl_loss(c["scores"], c["topk"], query, key, module.scaling, state.coeff)
            detached = loss.detach().float()
            state.logged_sum = detached if state.logged_sum is None else state.logged_sum + detached
            state.logged_count += 1
            return (_AttachLoss.apply(output[0], loss, state.scale), *output[1:])

        attn.register_forward_pre_hook(start, with_kwargs=True)
        attn.indexer.register_forward_hook(indexed, with_kwargs=True)
        attn.register_forward_hook(finish, with_kwargs=True)
        installed += 1
    return installed
