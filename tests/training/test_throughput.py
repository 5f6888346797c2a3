"""Model FLOPs per token against Megatron-LM's published expressions, written out here with numbers.

Megatron-LM `num_floating_point_operations` (megatron/training/training.py, `transformer_flops`) for a batch of
B samples of s tokens, per token (divide by B * s), 3x forward+backward and 2 FLOPs per multiply-add:
  MLP        3 * 2 * H * ffn * (3 if swiglu else 2) * L          (MoE: moe_ffn * topk (+ shared ffn) per MoE layer)
  attention  3 * 2 * (H * (q + k + v) + q * H) * L                 q = heads * kv_channels, k = v = groups * kv_ch.
  core       3 * 2 * q / 2 * 2 * s * L                              (causal: half of QK^T and AV)
  logits     3 * 2 * H * V
For GPT-3 style models this is the closed form 72 B s L H^2 (1 + s / (12 H) + V / (12 H L)) (Narayanan et al.
2021, with the attention-score term halved for the causal mask as Megatron's code now does).
"""
import math
import subprocess
import sys

import pytest

from fsdp2_backend.training.throughput import (model_flops_per_token, peak_device_flops,
                                               peak_device_flops_for_name)


def test_gpt3_175b_equals_megatrons_closed_form():
    L, H, V, s, B = 96, 12288, 51200, 2048, 1536
    config = {"hidden_size": H, "num_hidden_layers": L, "num_attention_heads": 96, "intermediate_size": 4 * H,
              "vocab_size": V}
    expected_per_iteration = 72 * B * s * L * H ** 2 * (1 + s / (12 * H) + V / (12 * H * L))
    got = model_flops_per_token(config, s, gated_mlp=False) * B * s
    assert math.isclose(got, expected_per_iteration, rel_tol=1e-12)
    assert math.isclose(got, 3.3406e18, rel_tol=1e-4)  # about 3.34 EFLOP per 1536 x 2048 iteration


def test_llama3_8b_gqa_swiglu_equals_megatrons_terms():
    # Llama-3 8B: H 4096, 32 layers, 32 heads of 128, 8 KV heads, SwiGLU ffn 14336, vocab 128256, s 8192.
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "model_type": "llama"}
    mlp = 6 * 4096 * 14336 * 3 * 32
    attention = 6 * (4096 * (4096 + 1024 + 1024) + 4096 * 4096) * 32
    core = 6 * 4096 * 8192 * 32
    logits = 6 * 4096 * 128256
    expected = mlp + attention + core + logits
    assert expected == 51_470_401_536  # 5.15e10 FLOPs per token
    assert model_flops_per_token(config, 8192) == expected
    # a transformers config object reads the same; head_dim defaults to hidden / heads
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=14336, vocab_size=128256)
    assert model_flops_per_token(hf, 8192) == expected
    assert model_flops_per_token({k: v for k, v in config.items() if k != "head_dim"}, 8192) == expected
    assert model_flops_per_token({**config, "head_dim": None}, 8192) == expected


QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936}


def test_moe_counts_only_the_active_experts():
    s = 4096
    experts = 6 * 2048 * 768 * 8 * 3 * 48  # top-8 of 128 experts, SwiGLU, every layer
    attention = 6 * (2048 * (4096 + 512 + 512) + 4096 * 2048) * 48
    core = 6 * 4096 * s * 48
    logits = 6 * 2048 * 151936
    assert model_flops_per_token(QWEN3_30B_A3B, s) == experts + attention + core + logits
    # more experts in total: same FLOPs (router not counted, as in Megatron); more per token: more FLOPs
    assert model_flops_per_token({**QWEN3_30B_A3B, "num_experts": 256}, s) == model_flops_per_token(QWEN3_30B_A3B, s)
    assert (model_flops_per_token({**QWEN3_30B_A3B, "num_experts_per_tok": 9}, s)
            - model_flops_per_token(QWEN3_30B_A3B, s)) == 6 * 2048 * 768 * 3 * 48
    # a dense layer (mlp_only_layers) uses intermediate_size instead of the 8 experts
    with_dense = model_flops_per_token({**QWEN3_30B_A3B, "mlp_only_layers": [0]}, s)
    assert with_dense - model_flops_per_token(QWEN3_30B_A3B, s) == 6 * 2048 * 3 * (6144 - 768 * 8)


def test_moe_shared_experts_and_dense_first_layers():
    base = {"hidden_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "vocab_size": 1000,
            "intermediate_size": 4096, "moe_intermediate_size": 256, "num_experts_per_tok": 2}
    no_mlp = model_flops_per_token({**base, "intermediate_size": 0, "num_experts": 8,
                                    "moe_intermediate_size": 0}, 128)
    # qwen2_moe: one shared expert of 512 beside the top-2 of 8
    qwen2 = {**base, "num_experts": 8, "shared_expert_intermediate_size": 512}
    assert model_flops_per_token(qwen2, 128) - no_mlp == 6 * 1024 * 3 * (256 * 2 + 512) * 4
    # deepseek: first layer dense, two shared experts of moe_intermediate_size, top-2 of 8 routed
    deepseek = {**base, "n_routed_experts": 8, "n_shared_experts": 2, "first_k_dense_replace": 1}
    assert model_flops_per_token(deepseek, 128) - no_mlp == 6 * 1024 * 3 * (4096 * 1 + (256 * 2 + 256 * 2) * 3)


def test_multi_latent_attention_equals_megatrons_mla_terms():
    # DeepSeek-V2-Lite's attention: H 2048, 16 heads, no q LoRA, kv_lora_rank 512, qk 128 + rope 64, v 128.
    config = {"hidden_size": 2048, "num_hidden_layers": 1, "num_attention_heads": 16, "vocab_size": 1,
              "intermediate_size": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
              "qk_rope_head_dim": 64, "v_head_dim": 128}
    s = 4096
    q_term = 2048 * 16 * (128 + 64)
    linear = 6 * (q_term + 512 * (2048 + 16 * (128 + 128) + 1) + 2048 * 64 + 16 * 128 * 2048)
    core = 6 * (16 * (128 + 64) / 2 + 16 * 128 / 2) * s
    mlp_and_logits = 6 * 2048 * 1 * 3 + 6 * 2048 * 1
    assert model_flops_per_token(config, s) == linear + core + mlp_and_logits


def test_missing_fields_are_reported():
    with pytest.raises(ValueError, match="hidden_size"):
        model_flops_per_token({"num_hidden_layers": 2}, 16)
    # a composite (vision-language) config: the text model's config is used
    text = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
            "vocab_size": 100}
    assert model_flops_per_token({"text_config": text}, 16) == model_flops_per_token(text, 16)


def test_peak_device_flops():
    assert peak_device_flops("cpu") is None
    assert peak_device_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_device_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert peak_device_flops_for_name("NVIDIA H200") == 989e12
    assert peak_device_flops_for_name("NVIDIA H20") == 148e12
    assert peak_device_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_device_flops_for_name("NVIDIA L40S") == 362e12
    assert peak_device_flops_for_name("Ascend910B2") == 354e12
    assert peak_device_flops_for_name("Some Future Accelerator") is None


def test_module_is_torch_free():
    code = ("import sys; import fsdp2_backend.training.throughput as t; "
            "t.model_flops_per_token({'hidden_size': 8, 'num_hidden_layers': 1, 'num_attention_heads': 2, "
            "'intermediate_size': 16, 'vocab_size': 10}, 4); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _counted_training_flops(hf_config, seq_length, batch=2):
    """Forward + backward FLOPs of the transformers model counted by torch.utils.flop_counter, per token, with
    the attention core halved: eager attention computes QK^T and AV as dense bmm's (the only bmm's in these
    models) and masks half; Megatron's formula counts the causal half."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf_config._attn_implementation = "eager"
    hf_config._experts_implementation = "eager"  # per-expert F.linear: matmuls the counter sees (not grouped_mm)
    model = AutoModelForCausalLM.from_config(hf_config)
    ids = torch.randint(0, hf_config.vocab_size, (batch, seq_length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    core = by_op.get("aten.bmm", 0)
    assert core > 0, by_op  # the attention core was counted
    return (counter.get_total_flops() - core / 2) / (batch * seq_length)


def test_formula_matches_torch_flop_counter_on_tiny_qwen3_and_qwen3_moe():
    from transformers import Qwen3Config, Qwen3MoeConfig

    dense = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, vocab_size=512)
    # MoE: 8 experts, top-2, no dense layers; the router matmul (H x 8) is the only term the formula leaves out
    moe = Qwen3MoeConfig(hidden_size=128, intermediate_size=384, moe_intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, num_experts=8,
                         num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    for config in (dense, moe):
        counted = _counted_training_flops(config, seq_length=64)
        formula = model_flops_per_token(config, 64)
        assert abs(formula - counted) / counted < 0.05, (config.model_type, formula, counted)
