"""Step-3.5-Flash at test size: its config in the release's own key names, transformers' Step text model with
weights that make every feature matter (the reference), and that reference written in Step-3.5's on-disk layout."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]


def step35_config_dict(**overrides) -> dict:
    """A tiny config.json in Step-3.5-Flash's own key names (num_attention_groups, moe_layers_enum,
    attention_other_setting, per-layer rope_theta / partial_rotary_factors, lists padded for one MTP layer)."""
    values = dict(model_type="step3p5", architectures=["Step3p5ForCausalLM"], vocab_size=128, hidden_size=64,
                  intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_attention_groups=2,
                  head_dim=16, moe_num_experts=8, moe_top_k=2, moe_intermediate_size=16, share_expert_dim=24,
                  moe_layers_enum="1,2,3", layer_types=LAYER_TYPES + ["full_attention"], sliding_window=4,
                  attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 8,
                                           "num_attention_groups": 2, "head_dim": 16, "true_head_dim": 16},
                  rope_theta=[10000.0, 500.0, 10000.0, 500.0, 10000.0],
                  partial_rotary_factors=[0.5, 1.0, 0.5, 1.0, 0.5], use_head_wise_attn_gate=True,
                  use_moe_router_bias=True, need_fp32_gate=True, moe_router_activation="sigmoid",
                  moe_router_scaling_factor=2.5, swiglu_limits=[0, 0, 0.05, 0, 0],
                  swiglu_limits_shared=[0.04, 0, 0.05, 0, 0], num_nextn_predict_layers=1,
                  max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, rms_norm_eps=1e-5)
    values.update(overrides)
    return values


def step35_config(**overrides):
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    values = step35_config_dict(**overrides)
    values.pop("model_type")
    config = Step3p7TextConfig(**values)
    config._attn_implementation = "eager"
    return config


def step35_reference(config, large_mlp: bool = True):
    """transformers' Step text model + lm head, with weights that make every feature matter (`large_mlp` False:
    transformers' init for the MLP / expert weights, for training runs)."""
    from transformers.models.step3p7.modeling_step3p7 import Step3p7TextModel

    torch.manual_seed(0)
    text = Step3p7TextModel(config)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    with torch.no_grad():
        for name, t in list(text.named_parameters()) + list(text.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.normal_(0, 0.3)  # changes the selection (sigmoid scores are ~0.5 ± 0.1)
            elif "norm" in name:
                t.normal_(0, 0.2)  # zero-centred norms: 0 is the identity scale
            elif large_mlp and ("experts" in name or "mlp" in name):
                t.normal_(0, 0.2)  # activations large enough for the small clamp limits to bite
    return text.train(), head


def write_step35_checkpoint(path, text, head, config_dict):
    """Step-3.5's on-disk layout, written by hand from the reference's in-memory weights (plus one MTP layer)."""
    tensors = {"lm_head.weight": head.weight.detach().clone()}
    for name, t in text.state_dict().items():
        key, t = "model." + name, t.detach().clone()
        if ".mlp.experts.gate_up_proj" in key:
            gate, up = t.chunk(2, dim=1)
            tensors[key.replace("mlp.experts.gate_up_proj", "moe.gate_proj.weight")] = gate.contiguous()
            tensors[key.replace("mlp.experts.gate_up_proj", "moe.up_proj.weight")] = up.contiguous()
            continue
        key = (key.replace("mlp.experts.down_proj", "moe.down_proj.weight")
               .replace("mlp.gate.weight", "moe.gate.weight")
               .replace("mlp.gate.e_score_correction_bias", "moe.router_bias")
               .replace("mlp.shared_experts.", "share_expert."))
        tensors[key] = t
    tensors["model.layers.4.eh_proj.weight"] = torch.randn(64, 128)  # MTP: not part of the model, left alone
    tensors["model.layers.4.enorm.weight"] = torch.randn(64)
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config_dict))
    return tensors
