"""The `longcat_flash_ngram` model id (MindSpeed-LLM's LongCat-Flash-Lite): transformers' `LongcatFlashForCausalLM`
(MLA, two attention/MLP pairs per layer, MoE with zero-computation experts) with n-gram hashed embeddings added
to the token embedding, and its experts stacked as this project's `GroupedExperts` (expert parallel, grouped GEMM).

N-gram embeddings (LongCat-Flash-Lite's `config.json`: `ngram_vocab_size_ratio` r, `emb_neighbor_num` n,
`emb_split_num` k; model_type `longcat_flash_ngram`, registered here with transformers' AutoConfig): for each
order i in 2..n and split j < k, table t = (i-2)·k + j has V_t = r·vocab + 2t + 1 rows of width hidden / (k(n-1)).
A token's id for table t hashes it with its i-1 predecessors inside its document (an EOS restarts the history;
positions before the start read 0): id_t = (x_0 + Σ_{m=1}^{i-1} x_{-m} · (vocab^m mod V_t)) mod V_t, where x_{-m}
is the token m places back. The input embedding is (E[x] + Σ_t P_t(N_t[id_t])) / (1 + k(n-1)) with `embedders.t`
(N_t) and the bias-free `post_projs.t` (P_t) under `model.ngram_embeddings` — the checkpoint's names, and the
YAMLs' FSDP units. Generation with a cache recomputes the history from the ids it is given (training never
caches).
"""
from __future__ import annotations

from typing import List, Mapping

import torch
from torch import nn
from transformers.models.longcat_flash import modeling_longcat_flash as lc
from transformers.models.longcat_flash.configuration_longcat_flash import LongcatFlashConfig

from fsdp2_backend.models import hf_layout
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.moe.family_swap import grouped_experts
from fsdp2_backend.models.moe.grouped_causal_lm import GroupedMoECausalLM


class LongcatFlashNgramConfig(LongcatFlashConfig):
    model_type = "longcat_flash_ngram"

    def __init__(self, ngram_vocab_size_ratio: int = 78, emb_neighbor_num: int = 4, emb_split_num: int = 4,
                 **kwargs):
        self.ngram_vocab_size_ratio = ngram_vocab_size_ratio
        self.emb_neighbor_num = emb_neighbor_num
        self.emb_split_num = emb_split_num
        super().__init__(**kwargs)


class NgramEmbeddings(nn.Module):
    """The n-gram tables and their projections (module docstring); `forward(ids, token_embeds)`."""

    def __init__(self, config):
        super().__init__()
        self.vocab, self.order, self.splits = config.vocab_size, config.emb_neighbor_num, config.emb_split_num
        self.eos = config.eos_token_id if isinstance(config.eos_token_id, int) else None
        tables = self.splits * (self.order - 1)
        width = config.hidden_size // tables
        base = config.ngram_vocab_size_ratio * config.vocab_size
        self.sizes = [int(base + 2 * t + 1) for t in range(tables)]
        self.embedders = nn.ModuleList(nn.Embedding(size, width, padding_idx=config.pad_token_id) for size in self.sizes)
        self.post_projs = nn.ModuleList(nn.Linear(width, config.hidden_size, bias=False) for _ in self.sizes)

    def history(self, ids: torch.Tensor) -> List[torch.Tensor]:
        """[the token m places back, within its document (0 before the start / an EOS)] for m = 1..n-1."""
        if self.eos is None:
            doc = torch.zeros_like(ids)
        else:  # document index: EOS ends a document (the token after it starts a new one)
            ends = (ids == self.eos).long()
            doc = torch.cumsum(ends, dim=-1) - ends
        back = []
        for m in range(1, self.order):
            shifted = torch.zeros_like(ids)
            shifted[:, m:] = ids[:, :-m]
            same = torch.zeros_like(ids, dtype=torch.bool)
            same[:, m:] = doc[:, m:] == doc[:, :-m]
            back.append(torch.where(same, shifted, torch.zeros_like(ids)))
        return back

    def forward(self, ids: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        back = self.history(ids)
        out = token_embeds
        for i in range(2, self.order + 1):
            for j in range(self.splits):
                t = (i - 2) * self.splits + j
                size = self.sizes[t]
                hashed = ids.clone()
                for m in range(1, i):
                    hashed = hashed + back[m - 1] * pow(self.vocab, m, size)
                out = out + self.post_projs[t](self.embedders[t](hashed % size)).to(out.dtype)
        return out / (1 + len(self.sizes))


class LongcatFlashNgramForCausalLM(GroupedMoECausalLM, lc.LongcatFlashForCausalLM):
    """LongCat-Flash with n-gram embeddings and `GroupedExperts`."""

    config_class = LongcatFlashNgramConfig
    hf_experts_class = lc.LongcatFlashExperts

    def __init__(self, config):
        super().__init__(config)
        self.model.ngram_embeddings = NgramEmbeddings(config)
        for module in list(self.modules()):
            if isinstance(module, lc.LongcatFlashMoE):
                module.experts = grouped_experts(module.experts)

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.model.ngram_embeddings(input_ids, self.model.embed_tokens(input_ids))
        return super().forward(input_ids=None, inputs_embeds=inputs_embeds, **kwargs)


def register_with_transformers() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        AutoConfig.register("longcat_flash_ngram", LongcatFlashNgramConfig)
        AutoModelForCausalLM.register(LongcatFlashNgramConfig, LongcatFlashNgramForCausalLM)
    except ValueError:  # registered already (each process registers once)
        pass


def build_longcat_ngram(hf_config) -> LongcatFlashNgramForCausalLM:
    return LongcatFlashNgramForCausalLM(hf_config)


def checkpoint_keys(name: str, hf_config) -> List[str]:
    return hf_layout.checkpoint_keys(name, _plain(hf_config), lc.LongcatFlashForCausalLM)


def param_from_checkpoint(name: str, tensors: Mapping[str, torch.Tensor], hf_config) -> torch.Tensor:
    return hf_layout.param_from_checkpoint(name, tensors, _plain(hf_config), lc.LongcatFlashForCausalLM)


def stored_layout(name: str, tensor: torch.Tensor, hf_config) -> torch.Tensor:
    """A tensor stored under the parameter's own name: MindSpeed v26.1.0's LongCat YAML loads experts merged
    offline (models/merged_experts.py), read into the stacked experts."""
    from fsdp2_backend.models.merged_experts import from_merged

    return from_merged(name, tensor, hf_config.n_routed_experts, hf_config.hidden_size,
                       hf_config.expert_ffn_hidden_size)


def _plain(hf_config) -> LongcatFlashConfig:
    """The config as transformers' own LongCat-Flash (its key layout: the n-gram keys are the model's own names)."""
    values = hf_config.to_dict()
    for key in ("model_type", "ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num", "transformers_version"):
        values.pop(key, None)
    return LongcatFlashConfig(**values)


def configure_longcat(model: nn.Module, config) -> None:
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.use_grouped_gemm = config.optimization.moe_grouped_gemm
