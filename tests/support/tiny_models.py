"""Tiny real models: a tiny HF config for every model id of the registry (fsdp2_backend/models/registry.py,
`TINY_CONFIGS`), and a tiny Qwen3 directory with a locally trained tokenizer (`tiny_model_dir`).

Nothing here stands in for the code under test: models are real transformers models built from configs,
tokenizers are real byte-level BPE tokenizers trained on local text (cli/demo_assets.py, shared with the demo)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from fsdp2_backend.cli.demo_assets import (build_tiny_model_dir, stdlib_texts, tiny_qwen3_config,  # noqa: F401
                                           train_bytelevel_tokenizer)
from fsdp2_backend.config.schema import ModelArguments
from fsdp2_backend.models.mamba3.modeling import Mamba3Config
from fsdp2_backend.models.registry import model_spec
from tests.support.router_reference import E
from tests.support.step35_reference import step35_config


def text_parquet_and_tokenizer(root, model_name: str, vocab_size: int = 300):
    """(train.parquet of local standard-library texts, the model directory `root/model_name` holding a byte-level
    tokenizer trained on them, that tokenizer): the assets of the raw-text training tests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = root / "train.parquet"
    pq.write_table(pa.table({"text": stdlib_texts(max_files=32, max_chars=2000)}), str(parquet))
    model = root / model_name
    return parquet, model, train_bytelevel_tokenizer(model, vocab_size=vocab_size)


def tiny_model_dir(path, seed: int, vocab_size: int = 300, **overrides) -> str:
    """An HF directory holding a locally trained tokenizer and a seeded tiny Qwen3 sized to its vocabulary."""
    tokenizer = train_bytelevel_tokenizer(path, vocab_size=vocab_size)
    build_tiny_model_dir(path, vocab_size=len(tokenizer), seed=seed, **overrides)
    return str(path)


def tiny_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.02,
                  output_router_logits=True, max_position_embeddings=64, tie_word_embeddings=False)
    values.update(overrides)
    config = Qwen3MoeConfig(**values)
    config._experts_implementation = "eager"  # transformers' reference loop over experts
    return config


def tiny_next_config(**overrides):
    from transformers import Qwen3NextConfig

    values = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.02, output_router_logits=True,
                  max_position_embeddings=128, tie_word_embeddings=False, mlp_only_layers=[1])
    values.update(overrides)
    config = Qwen3NextConfig(**values)
    config._experts_implementation = "eager"  # transformers' reference loop over experts
    return config


def tiny_gpt_oss_config(**overrides):
    from transformers import GptOssConfig

    values = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  max_position_embeddings=64, layer_types=["sliding_attention", "full_attention"],
                  output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)
    values.update(overrides)
    config = GptOssConfig(**values)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def tiny_minimax_config(**overrides):
    from transformers import MiniMaxM2Config

    values = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=64, rotary_dim=8, output_router_logits=True, router_aux_loss_coef=0.02,
                  tie_word_embeddings=False)
    values.update(overrides)
    config = MiniMaxM2Config(**values)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def tiny_mamba3_config(**overrides) -> Mamba3Config:
    values = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, state_size=16, head_dim=8, n_groups=2,
                  chunk_size=8)
    values.update(overrides)
    return Mamba3Config(**values)


NEWER_VOCAB = 96


def tiny_newer_config(model_id, vocab_size=NEWER_VOCAB):
    """A tiny config of one of the ids MindSpeed-LLM added after the seed (deepseek_v4, glm52, longcat_flash_ngram)."""
    from transformers import DeepseekV4Config, GlmMoeDsaConfig

    if model_id == "deepseek_v4":
        return DeepseekV4Config(
            vocab_size=vocab_size, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
            n_shared_experts=1, max_position_embeddings=128, o_groups=2, o_lora_rank=8, index_n_heads=2,
            index_head_dim=8, index_topk=4, sliding_window=4, qk_rope_head_dim=8, hc_mult=2, swiglu_limit=0.05,
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            mlp_layer_types=["hash_moe", "moe"],  # one hash-routed layer, one top-k layer
            # one compressed-sparse-attention layer (the lightning indexer and its KL loss), one heavily compressed
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            tie_word_embeddings=False)
    if model_id == "glm52":
        return GlmMoeDsaConfig(
            vocab_size=vocab_size, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=8,
            q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, index_topk=4, index_head_dim=8,
            index_n_heads=2, first_k_dense_replace=1, max_position_embeddings=128, tie_word_embeddings=False)
    from fsdp2_backend.models.longcat_flash_ngram.modeling import LongcatFlashNgramConfig

    return LongcatFlashNgramConfig(
        vocab_size=vocab_size, hidden_size=48, num_layers=1, num_attention_heads=2, num_key_value_heads=2,
        ffn_hidden_size=32, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, head_dim=8,
        v_head_dim=8, moe_topk=2, n_routed_experts=4, zero_expert_num=2, expert_ffn_hidden_size=16,
        max_position_embeddings=128, ngram_vocab_size_ratio=2, emb_neighbor_num=3, emb_split_num=2,
        eos_token_id=5, pad_token_id=0, tie_word_embeddings=False)


def save_tiny(model_id, path, seed=0, vocab_size=NEWER_VOCAB):
    """A seeded tiny model of `model_id` (a newer id) saved by transformers (router biases non-zero)."""
    from fsdp2_backend.models.registry import model_spec

    spec = model_spec(model_id)
    if spec.register_hf:
        spec.register_hf()
    torch.manual_seed(seed)
    model = spec.build(tiny_newer_config(model_id, vocab_size))
    model.init_weights() if hasattr(model, "init_weights") else None
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    model.save_pretrained(str(path))
    return model


def engine_model(model_id, path):
    """The engine's model of `model_id` loaded from the HF directory `path` (streamed, meta-device init)."""
    from fsdp2_backend.models.loading import create_model, load_hf_config

    args = ModelArguments(model_name_or_path=str(path), model_id=model_id, init_model_with_meta_device=True)
    hf_config = load_hf_config(args)
    return create_model(args, hf_config, seed=1, device=torch.device("cpu"), parallelize=lambda m: m)


def tiny_family_config(family: str, **overrides):
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig

    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False, num_experts_per_tok=4)
    if family == "mixtral":
        config = MixtralConfig(**common, intermediate_size=16, num_local_experts=E, output_router_logits=True,
                               router_aux_loss_coef=0.02, **overrides)
    elif family == "qwen2_moe":
        config = Qwen2MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_experts=E,
                                shared_expert_intermediate_size=24, norm_topk_prob=True, output_router_logits=True,
                                router_aux_loss_coef=0.02, **overrides)
    else:
        common.update(num_key_value_heads=4)
        config = DeepseekV3Config(**common, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=E,
                                  n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.0,
                                  first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                  qk_rope_head_dim=8, v_head_dim=8, **overrides)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # transformers' reference loop over experts
    return config


# A tiny HF config for every model id of the registry, built on call.
TINY_CONFIGS = {"qwen3": tiny_qwen3_config, "qwen3_moe": tiny_moe_config, "qwen3_next": tiny_next_config,
                "mamba3": tiny_mamba3_config, "gpt_oss": tiny_gpt_oss_config, "minimax_m27": tiny_minimax_config,
                "step35": step35_config,
                **{name: (lambda name=name: tiny_family_config(name))
                   for name in ("deepseek_v3", "mixtral", "qwen2_moe")},
                **{name: (lambda name=name: tiny_newer_config(name))
                   for name in ("deepseek_v4", "glm52", "longcat_flash_ngram")}}


def mamba3_mindspeed_dir(path: Path) -> str:
    """MindSpeed's mamba3 checkpoint layout in miniature: a transformers Mamba-2 config.json with the Mamba-3
    keys and the mamba_ssm spellings MindSpeed writes, plus a locally trained tokenizer."""
    tokenizer = train_bytelevel_tokenizer(path, vocab_size=300)
    fields = dict(model_type="mamba2", architectures=["Mamba3ForCausalLM"], hidden_size=32, d_model=32,
                  num_hidden_layers=2, n_layer=2, state_size=16, d_state=16, head_dim=8, headdim=8, num_heads=8,
                  n_groups=1, expand=2, vocab_size=len(tokenizer), chunk_size=16, conv_kernel=4,
                  layer_norm_epsilon=1e-5, is_mimo=False, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    return str(path)


HIDDEN, Q_RANK, KV_RANK = 64, 16, 8


def tiny_mla_config(q_lora_rank=Q_RANK):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(vocab_size=128, hidden_size=HIDDEN, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                            topk_group=1, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK, qk_nope_head_dim=8,
                            qk_rope_head_dim=4, v_head_dim=8, max_position_embeddings=64, attn_implementation="eager")


def tiny_next_dir(path):
    import torch
    from transformers import Qwen3NextForCausalLM

    tokenizer = train_bytelevel_tokenizer(path, vocab_size=300)
    torch.manual_seed(0)
    Qwen3NextForCausalLM(tiny_next_config(vocab_size=len(tokenizer), max_position_embeddings=256)).save_pretrained(
        str(path))
    return str(path)


def minimax_pair():
    from transformers import MiniMaxM2ForCausalLM

    torch.manual_seed(0)
    hf = MiniMaxM2ForCausalLM(tiny_minimax_config())
    with torch.no_grad():  # transformers initialises the bias to 0 and the norms to 1: make them matter
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.3)
            elif "norm" in name:
                t.normal_(1, 0.2)
    ours = model_spec("minimax_m27").build(tiny_minimax_config())
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.train(), ours.train()
