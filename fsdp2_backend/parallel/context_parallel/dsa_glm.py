"""Context parallel for the `glm52` model id (transformers' glm_moe_dsa): MindSpeed-LLM's `cp_type: kvallgather`.

Each cp rank keeps its own queries, in the layout `batch.shard_batch_for_cp` gave them (ring's head-tail chunks or
Ulysses' contiguous slice: the two differ only in token order), and all-gathers what the keys are made from:
- the MLA key latents (k_pass after kv_a_layernorm, k_rot roped with this rank's positions), with gradient: the
  gather's backward sums over the ranks, so each rank's kv projections get the gradient of every rank's queries;
- the lightning indexer's keys (k_norm(wk(h)), roped), without gradient (transformers' indexer is no_grad).
Both are put back into sequence order, so a top-k index is a GLOBAL key position on every rank — what the "shared"
indexer layers reuse from the layer before (`prev_topk_indices`) and what the indexer KL loss gathers its keys by.
The indexer scores the local queries against all keys under the causal mask of the global sequence positions and
takes transformers' top-k; the attention of the local queries over the selected keys is transformers' eager/SDPA
path (its own attention function, the mask built as it builds it). In fp32 the values are cp 1's for these queries.

`enable_glm_context_parallel` swaps the classes of every `GlmMoeDsaAttention` and its indexer to the subclasses
below (state dict, hooks and isinstance checks unchanged) and gives both a `context_parallel` attribute, the
`GlmContextParallel` of the cp group: `models/dsa_indexer_loss.py` reads it to gather the keys of its KL loss.
Declined (UsageError): packed documents (restarting position ids), a KV cache, attention dropout, and the
packing kwargs (cu_seq_lens).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from fsdp2_backend.parallel.context_parallel.dsa import SequenceLayout
from fsdp2_backend.usage_errors import UsageError

Tensor = torch.Tensor
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class GlmContextParallel(SequenceLayout):
    """The shared layout (`dsa.SequenceLayout`) and the causal mask of this rank's queries over the whole
    sequence."""

    def causal_mask(self, batch: int, local_length: int, device) -> Tensor:
        """(batch, local_length, whole length) bool: key j is visible to this rank's query i when j <= i's
        position in the sequence."""
        queries = self.positions(local_length, device)
        mask = torch.arange(local_length * self.size, device=device)[None, :] <= queries[:, None]
        return mask.unsqueeze(0).expand(batch, -1, -1)


class GlmContextParallelIndexer(glm.GlmMoeDsaIndexer):
    """transformers' indexer for this rank's queries over every rank's keys (`attention_mask`: the causal mask
    of `GlmContextParallel.causal_mask`); returns global key positions."""

    context_parallel: GlmContextParallel

    @torch.no_grad()
    def forward(self, hidden_states: Tensor, q_resid: Tensor, position_embeddings, attention_mask: Tensor,
                position_ids: Optional[Tensor] = None, cache=None) -> Tensor:
        from fsdp2_backend.models.dsa_indexer_loss import glm_index_scores  # its keys gathered by context_parallel

        cos, sin = position_embeddings
        scores = glm_index_scores(self, hidden_states, q_resid, cos, sin).masked_fill(~attention_mask, float("-inf"))
        return scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices.to(torch.int32)


class GlmContextParallelAttention(glm.GlmMoeDsaAttention):
    """transformers' GlmMoeDsaAttention for this rank's queries, keys gathered from every cp rank."""

    context_parallel: GlmContextParallel

    def forward(self, hidden_states: Tensor, position_embeddings, attention_mask=None, cache=None,
                position_ids: Optional[Tensor] = None, prev_topk_indices: Optional[Tensor] = None, **kwargs):
        cp = self.context_parallel
        if cache is not None:
            raise UsageError("context parallel (cp_size > 1) for model_id glm52: no KV cache (generation) — run "
                             "with use_cache False, or cp_size 1")
        if any(kwargs.get(name) is not None for name in _PACKING_KWARGS):
            raise UsageError("context parallel (cp_size > 1) for model_id glm52: packed documents (cu_seq_lens) are "
                             "not supported — train on unpacked sequences, or use cp_size 1")
        batch, length = hidden_states.shape[:-1]
        cp.check_unpacked(position_ids, batch)
        # the model's mask (`attention_mask`) is of the local tokens alone: the mask is the global sequence's
        mask = cp.causal_mask(batch, length, hidden_states.device)

        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q_states = self.q_b_proj(q_resid).view(batch, length, -1, self.qk_head_dim).transpose(1, 2)
        q_pass, q_rot = torch.split(q_states, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states),
                                     [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pass = self.kv_a_layernorm(kv_pass).view(batch, 1, length, self.kv_lora_rank)
        k_rot = k_rot.view(batch, 1, length, self.qk_rope_head_dim)
        cos, sin = position_embeddings
        q_rot, k_rot = glm.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        # one gather of both latents (roped with their own positions), then transformers' expansion per head
        k_pass, k_rot = torch.split(cp.gather(torch.cat([k_pass, k_rot], dim=-1), dim=2),
                                    [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        query_states = torch.cat((q_pass, q_rot), dim=-1)
        key_states, value_states = self.expand_kv(k_pass, k_rot)

        if self.indexer is not None:
            topk_indices = self.indexer(hidden_states, q_resid, position_embeddings, mask, position_ids)
        elif prev_topk_indices is None:
            raise ValueError("Shared DSA layers require top-k indices from a previous full indexer layer.")
        else:
            topk_indices = prev_topk_indices
        selected = torch.zeros_like(mask).scatter(-1, topk_indices.long(), True)
        allowed = (mask & selected).unsqueeze(1)  # transformers: the causal mask without the unselected keys
        implementation = self.config._attn_implementation
        if implementation == "sdpa":
            attention_mask = allowed
        else:  # eager's additive mask (any other implementation runs as eager here: same maths)
            implementation = "eager"
            attention_mask = torch.zeros(allowed.shape, dtype=query_states.dtype, device=allowed.device)
            attention_mask = attention_mask.masked_fill(~allowed, torch.finfo(query_states.dtype).min)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, glm.eager_attention_forward)
        attn_output, attn_weights = attention(self, query_states, key_states, value_states, attention_mask,
                                              dropout=0.0, scaling=self.scaling)
        attn_output = self.o_proj(attn_output.reshape(batch, length, -1).contiguous())
        return attn_output, attn_weights, topk_indices


def enable_glm_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str) -> int:
    """Makes every GlmMoeDsaAttention of `model` context parallel over `cp_mesh` (1-D); returns how many.
    Call with the attention CP stage (before recompute and FSDP); the batch is cut by `shard_batch_for_cp`."""
    if getattr(model.config, "attention_dropout", 0.0):
        raise UsageError(f"attention_dropout: {model.config.attention_dropout} is not supported with context "
                         "parallel — set it to 0")
    cp = GlmContextParallel(cp_mesh.get_group(), cp_type, "glm52")
    layers = [m for m in model.modules() if isinstance(m, glm.GlmMoeDsaAttention)]
    for attention in layers:
        if isinstance(attention, GlmContextParallelAttention):
            raise RuntimeError("enable_glm_context_parallel called twice on the same model")
        attention.__class__, attention.context_parallel = GlmContextParallelAttention, cp
        if attention.indexer is not None:
            attention.indexer.__class__, attention.indexer.context_parallel = GlmContextParallelIndexer, cp
    return len(layers)
