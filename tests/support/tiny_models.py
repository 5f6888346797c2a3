"""Tiny real models: a tiny HF config for every model id of the registry (fsdp2_backend/models/registry.py,
`TINY_CONFIGS`), and a tiny Qwen3 directory with a locally trained tokenizer (`tiny_model_dir`).

Nothing here stands in for the code under test: models are real transformers models built from configs,
tokenizers are real byte-level BPE tokenizers trained on local text (cli/demo_assets.py, shared with the demo)."""
from __future__ import annotations

from fsdp2_backend.cli.demo_assets import (build_tiny_model_dir, stdlib_texts, tiny_qwen3_config,  # noqa: F401
                                           train_bytelevel_tokenizer)
from fsdp2_backend.models.mamba3.modeling import Mamba3Config


def tiny_model_dir(path, seed: int, vocab_size: int = 300, **overrides) -> str:
    """An HF directory holding a locally trained tokenizer and a seeded tiny Qwen3 sized to its vocabulary."""
    tokenizer = train_bytelevel_tokenizer(path, vocab_size=vocab_size)
    build_tiny_model_dir(path, vocab_size=len(tokenizer), seed=seed, **overrides)
    return str(path)


def _qwen3():
    return tiny_qwen3_config()


def _qwen3_moe():
    from tests.support.tiny_models import tiny_moe_config
    return tiny_moe_config()


def _qwen3_next():
    from tests.support.tiny_models import tiny_next_config
    return tiny_next_config()


def _mamba3():
    from tests.support.tiny_models import tiny_mamba3_config
    return tiny_mamba3_config()


def _gpt_oss():
    from tests.support.tiny_models import tiny_gpt_oss_config
    return tiny_gpt_oss_config()


def _minimax():
    from tests.support.tiny_models import tiny_minimax_config
    return tiny_minimax_config()


def _step35():
    from tests.models.test_step35 import step35_config
    return step35_config()


def _family(name):
    def build():
        from tests.models.test_router_families import _config
        return _config(name)
    return build


def _newer(name):
    def build():
        from tests.models.test_newer_model_ids import tiny_mamba3_config
        return tiny_mamba3_config(name)
    return build


TINY_CONFIGS = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next, "mamba3": _mamba3,
                "gpt_oss": _gpt_oss, "minimax_m27": _minimax, "step35": _step35,
                **{name: _family(name) for name in ("deepseek_v3", "mixtral", "qwen2_moe")},
                **{name: _newer(name) for name in ("deepseek_v4", "glm52", "longcat_flash_ngram")}}


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
