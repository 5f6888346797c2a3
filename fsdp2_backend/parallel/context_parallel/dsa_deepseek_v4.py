"""Context parallel for the `deepseek_v4` model id (MindSpeed-LLM's `cp_type: kvallgather`): transformers'
DeepSeek-V4 attention, its compressors (CSA, HCA) and the CSA's lightning indexer computed for this cp rank's queries
over the whole sequence's keys, with the values transformers' eager attention gives them at cp 1.

Each cp rank holds some tokens of every sequence (ring's head-tail chunks or Ulysses' contiguous slice,
`batch.shard_batch_for_cp`; the layouts differ in token order only) with their global `position_ids`. Per layer:
- queries (the attention's and the indexer's) stay local, roped at their own positions;
- what keys are made from is all-gathered with gradient (`all_gather_single_autograd`, whose backward sums every
  rank's gradient into the owner's chunk) and put back in sequence order: the shared K=V head of
  the sliding window, and the compressors' kv/gate projections (the CSA compressor's, its indexer's, the HCA's) —
  the compressed entries are then computed over the whole sequence exactly as transformers does at cp 1 (windows
  may cross the cp chunks; the cheaper gather: 2 x 2 x head_dim per token rather than hidden_size);
- masks come from global positions: causal + sliding window over the gathered keys, the HCA entries' causal
  threshold, the indexer's top-k (CSA) with its causal threshold;
- attention is transformers' `eager_attention_forward` (sinks included; the model's own attention implementation
  is not consulted: DeepSeek-V4's block bias is eager's), then the output de-rotation and the grouped output
  projection on the local tokens.
Cost: the whole sequence's K=V head (S x head_dim) and scores S_local x (S + entries) per layer (eager at cp 1 holds
S x S; the window would need only S_local x (window + chunk)); every rank compresses the whole sequence (the
compressors' cp-1 work on each rank: small next to the attention and the projections).

The forwards replace the modules' own as instance attributes, so the hooks on those modules (the indexer KL loss,
models/dsa_indexer_loss.py, installed before this stage) fire with the same arguments: they see local queries and
scores and the whole sequence's compressed keys, and each rank's indexer loss is the mean over its own queries.

The whole sequence's order is the layout `batch.shard_batch_for_cp` gave the tokens (`dsa.SequenceLayout`, shared
with glm52). Packed documents (restarting position ids, gathered once per forward) are declined with a UsageError
(config validation declines the packing options first), as is a KV cache (training forwards only).
"""
from __future__ import annotations

import types

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dv4

from fsdp2_backend.parallel.context_parallel.dsa import SequenceLayout
from fsdp2_backend.usage_errors import UsageError

_CP_ATTRIBUTE = "_deepseek_v4_cp"


def _layout(module: nn.Module) -> SequenceLayout:
    return module.__dict__[_CP_ATTRIBUTE]


def _gathered_projections(module: nn.Module, hidden_states: Tensor, position_ids: Tensor):
    """A compressor's (or indexer's) kv and gate projections of the whole sequence: one gather for both."""
    kv, gate = module.kv_proj(hidden_states), module.gate_proj(hidden_states)
    both = _layout(module).gather(torch.cat([kv, gate], dim=-1), 1)
    return both.split([kv.shape[-1], gate.shape[-1]], dim=-1)


def _compress(module: nn.Module, kv: Tensor, gate: Tensor, overlap: bool) -> Tensor:
    """transformers' stateless compression of a whole sequence's windows (no cache): [B, entries, head_dim].
    `overlap`: CSA (and its indexer), each entry mixes the previous window's Ca half with its own Cb half; HCA's
    windows do not overlap."""
    batch, ratio, head_dim = kv.shape[0], module.compress_rate, module.head_dim
    n_windows = kv.shape[1] // ratio
    if n_windows == 0:
        return kv.new_zeros((batch, 0, head_dim))
    chunk_kv = kv[:, :n_windows * ratio].reshape(batch, n_windows, ratio, -1)
    chunk_gate = gate[:, :n_windows * ratio].reshape(batch, n_windows, ratio, -1) + module.position_bias
    if overlap:
        new_kv = chunk_kv.new_zeros((batch, n_windows, 2 * ratio, head_dim))
        new_gate = chunk_gate.new_full((batch, n_windows, 2 * ratio, head_dim), float("-inf"))
        new_kv[:, :, ratio:] = chunk_kv[..., head_dim:]
        new_gate[:, :, ratio:] = chunk_gate[..., head_dim:]
        if n_windows > 1:
            new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, :, :head_dim]
            new_gate[:, 1:, :ratio] = chunk_gate[:, :-1, :, :head_dim]
        chunk_kv, chunk_gate = new_kv, new_gate
    compressed = module.kv_norm((chunk_kv * chunk_gate.softmax(dim=2, dtype=torch.float32).to(chunk_kv.dtype))
                                .sum(dim=2))
    positions = (torch.arange(n_windows, device=compressed.device) * ratio).unsqueeze(0).expand(batch, -1)
    cos, sin = module.rotary_emb(compressed, position_ids=positions, layer_type=module.rope_layer_type)
    return dv4.apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)


def _no_cache(cache) -> None:
    if cache is not None:
        raise UsageError("context parallel (model_id deepseek_v4) runs training forwards only — call the model with "
                         "use_cache=False, or use cp_size 1")


def _indexer_forward(self: dv4.DeepseekV4Indexer, hidden_states: Tensor, q_residual: Tensor, position_ids: Tensor,
                     cache=None, layer_idx: int = 0) -> Tensor:
    """DeepseekV4Indexer.forward for the local queries: top-k [B, S_local, k] over the whole sequence's entries."""
    _no_cache(cache)
    batch, seq_len, _ = hidden_states.shape
    kv, gate = _gathered_projections(self, hidden_states, position_ids)
    compressed_kv = _compress(self, kv, gate, overlap=True)
    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = dv4.apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)
    index_scores = self.scorer(q, compressed_kv, hidden_states)  # [B, S_local, T]
    compressed_len = compressed_kv.shape[1]
    top_k = min(self.index_topk, compressed_len)
    if compressed_len == 0:
        return index_scores.topk(top_k, dim=-1).indices
    # as transformers: no pick at or past the query's causal threshold; such picks (too few ready entries) are -1
    causal_threshold = ((position_ids + 1) // self.compress_rate).unsqueeze(-1)  # [B, S_local, 1]
    entries = torch.arange(compressed_len, device=index_scores.device).view(1, 1, -1)
    top_k_indices = index_scores.masked_fill(entries >= causal_threshold, float("-inf")).topk(top_k, dim=-1).indices
    return torch.where(top_k_indices >= causal_threshold, torch.full_like(top_k_indices, -1), top_k_indices)


def _csa_forward(self: dv4.DeepseekV4CSACompressor, hidden_states: Tensor, q_residual: Tensor, position_ids: Tensor,
                 cache=None, layer_idx: int = 0):
    """DeepseekV4CSACompressor.forward: the whole sequence's entries [B, 1, T, D] and the local queries' block bias
    [B, 1, S_local, T] (0 on the indexer's valid picks, -inf elsewhere)."""
    _no_cache(cache)
    batch, seq_len, _ = hidden_states.shape
    kv, gate = _gathered_projections(self, hidden_states, position_ids)
    compressed_kv = _compress(self, kv, gate, overlap=True).unsqueeze(1)
    top_k_indices = self.indexer(hidden_states, q_residual, position_ids, None, layer_idx)  # positional: its hooks
    compressed_len = compressed_kv.shape[2]
    valid = top_k_indices >= 0
    safe_indices = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, compressed_len))
    block_bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
    block_bias.scatter_(-1, safe_indices.unsqueeze(1), 0.0)
    return compressed_kv, block_bias[..., :compressed_len]


def _hca_forward(self: dv4.DeepseekV4HCACompressor, hidden_states: Tensor, q_residual: Tensor, position_ids: Tensor,
                 cache=None, layer_idx: int = 0):
    """DeepseekV4HCACompressor.forward: the whole sequence's entries and the local queries' causal block bias
    (query t sees entry w when t + 1 >= (w + 1) * compress_rate, i.e. the entry's window is closed)."""
    _no_cache(cache)
    batch, seq_len, _ = hidden_states.shape
    kv, gate = _gathered_projections(self, hidden_states, position_ids)
    compressed_kv = _compress(self, kv, gate, overlap=False).unsqueeze(1)
    compressed_len = compressed_kv.shape[2]
    if compressed_len == 0:
        return compressed_kv, None
    entries = torch.arange(compressed_len, device=compressed_kv.device).view(1, 1, 1, -1)
    causal_threshold = ((position_ids + 1) // self.compress_rate).view(batch, 1, seq_len, 1)
    block_bias = compressed_kv.new_zeros((batch, 1, seq_len, compressed_len))
    return compressed_kv, block_bias.masked_fill(entries >= causal_threshold, float("-inf"))


def _window_mask(position_ids: Tensor, seq_len: int, window: int, dtype: torch.dtype) -> Tensor:
    """The causal sliding-window mask [B, 1, S_local, S] of the local queries over the whole sequence, additive as
    transformers' eager mask (0 allowed, the dtype's minimum elsewhere): key k is seen by query q when
    q - window < k <= q."""
    q = position_ids.unsqueeze(-1)
    k = torch.arange(seq_len, device=position_ids.device).view(1, 1, -1)
    allowed = (k <= q) & (k > q - window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min).unsqueeze(1)


def _attention_forward(self: dv4.DeepseekV4Attention, hidden_states: Tensor, position_embeddings: dict,
                       position_ids: Tensor, attention_mask=None, cache=None, **kwargs):
    """DeepseekV4Attention.forward for the local tokens (the model's `attention_mask`, built for the local
    sequence, is replaced by the one of global positions)."""
    _no_cache(cache)
    _layout(self).check_unpacked(position_ids, hidden_states.shape[0])
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = position_embeddings[self.rope_layer_type]

    q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
    q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
    q = dv4.apply_rotary_pos_emb(q, cos, sin)
    kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
    kv = _layout(self).gather(dv4.apply_rotary_pos_emb(kv, cos, sin), 2)  # [B, 1, S, D]
    mask = _window_mask(position_ids, kv.shape[2], self.sliding_window, q.dtype)

    if self.compressor is not None:
        compressed_kv, block_bias = self.compressor(hidden_states, q_residual, position_ids, None, self.layer_idx)
        kv = torch.cat([kv, compressed_kv], dim=2)
        if block_bias is not None:
            mask = torch.cat([mask, block_bias.to(mask.dtype)], dim=-1)

    attn_output, attn_weights = dv4.eager_attention_forward(
        self, q, kv, kv, mask, dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling)
    # K=V: undo the rope on the output's rope slice at the query position (transformers' de-rotation)
    attn_output = dv4.apply_rotary_pos_emb(attn_output.transpose(1, 2), cos, -sin).transpose(1, 2)
    grouped = self.o_a_proj(attn_output.reshape(*input_shape, self.config.o_groups, -1)).flatten(2)
    return self.o_b_proj(grouped), attn_weights


_FORWARDS = ((dv4.DeepseekV4Attention, _attention_forward), (dv4.DeepseekV4CSACompressor, _csa_forward),
             (dv4.DeepseekV4HCACompressor, _hca_forward), (dv4.DeepseekV4Indexer, _indexer_forward))


def enable_deepseek_v4_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, cp_type: str) -> None:
    """Gives every DeepSeek-V4 attention of `model` (main and MTP layers), compressor and indexer the forward above.
    `cp_type` ("ring" or "ulysses"): the batch layout (`batch.shard_batch_for_cp`)."""
    layout = SequenceLayout(cp_mesh.get_group(), cp_type, "deepseek_v4")
    for module in model.modules():
        for cls, forward in _FORWARDS:
            if isinstance(module, cls) and _CP_ATTRIBUTE not in module.__dict__:
                module.__dict__[_CP_ATTRIBUTE] = layout
                module.forward = types.MethodType(forward, module)
