"""Megatron-LM's gpt-oss flags (examples/gptoss/02_train.sh) build a GPT-OSS with the gpt_oss model id.

References: megatron-core 0.16.1's own functions for what each flag means — `is_layer_window_attention` (which
layers are windowed), `get_sliding_window_causal_mask`-style window semantics via flash-attention's (left, right)
convention checked against transformers' mask, `quick_gelu` and the clamped GLU of `experts.py`; transformers'
GPT-OSS for the model the config builds. The corpus line itself stays declined for its FP8 flags only; the line
minus them (sizes shrunk for 1 CPU process) trains steps through pretrain_fsdp2.py.
"""
import json
from pathlib import Path

import pytest
import torch

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.models.loading import load_hf_config
from megatron_compat.translate import translate_megatron
from tests.support.launchers import run_pretrain
from fsdp2_backend.usage_errors import UsageError

from tests.support.megatron_lines import FP8, edit_flags

LINES = json.loads((Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json").read_text())
LINE = LINES["megatron-lm:examples/gptoss/02_train.sh"]


def _hf_config(argv):
    fields = translate_megatron(argv).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    return fields, load_hf_config(config.model)


def test_the_line_translates_with_megatrons_delayed_fp8_recipe():
    """--fp8-format hybrid alone is Transformer Engine's DelayedScaling (Megatron's default recipe), with the
    line's own amax history (1024) and compute algorithm (max)."""
    model = translate_megatron(LINE).fields["model"]
    assert {k: model.get(k) for k in ("quant_recipe_name", "quant_fp8_format", "quant_fp8_amax_history_len",
                                      "quant_fp8_amax_compute_algo")} == {
        "quant_recipe_name": "delayed", "quant_fp8_format": "hybrid", "quant_fp8_amax_history_len": 1024,
        "quant_fp8_amax_compute_algo": "max"}


def test_line_minus_fp8_builds_megatrons_gpt_oss():
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.transformer.utils import is_layer_window_attention

    fields, hf = _hf_config(edit_flags(LINE, drop=tuple(FP8)))
    assert fields["model"]["model_id"] == "gpt_oss" and hf.model_type == "gpt_oss"
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == \
        (12, 512, 64, 8, 8)
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size) == (4, 2, 2048)
    # megatron-core's window placement, layer by layer (1-based layer numbers)
    assert hf.layer_types == ["sliding_attention" if is_layer_window_attention((127, 0), 2, i + 1)
                              else "full_attention" for i in range(12)]
    # plain RoPE at --rotary-base (not transformers' GPT-OSS default YaRN x32)
    assert hf.rope_parameters["rope_type"] == "default" and hf.rope_parameters["rope_theta"] == 10000.0
    assert (hf.attention_bias, hf.mlp_bias, hf.tie_word_embeddings) == (False, False, False)
    assert hf.swiglu_limit == 7.0 and hf.attention_dropout == 0.1  # Megatron's default attention dropout
    assert fields["model"]["moe_z_loss_coeff"] == 1e-3 and fields["model"]["moe_router_dtype"] == "fp32"

    # The GLU: megatron-core's expert activation (experts.py's glu with quick_gelu, clamp 7, offset 1) on the
    # same gate/linear halves = the model's experts (transformers' interleaved layout: gate even, linear odd).
    from fsdp2_backend.models.gpt_oss.modeling import GptOssGroupedExperts

    small = _hf_config(edit_flags(LINE, drop=tuple(FP8), hidden_size=16, moe_ffn_hidden_size=8, ffn_hidden_size=8,
                             num_attention_heads=4, num_query_groups=2))[1]
    torch.manual_seed(0)
    experts = GptOssGroupedExperts(small)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(5, 16) * 3
    counts = torch.tensor([5, 0, 0, 0])
    ours = experts.compute(x, counts)
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    x_glu, x_linear = gate_up[:, ::2].clamp(max=7.0), gate_up[:, 1::2].clamp(-7.0, 7.0)
    megatron = (quick_gelu(x_glu) * (x_linear + 1.0)) @ experts.down_proj[0] + experts.down_proj_bias[0]
    torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=1e-5)


def test_window_semantics_match_flash_attentions_left_right():
    """Megatron's --window-size (L, 0): query i sees keys i-L..i (flash-attention's convention); transformers'
    sliding_window L+1 built from it allows exactly those keys."""
    from fsdp2_backend.kernels.sink_attention import _allowed

    _, hf = _hf_config(edit_flags(LINE, drop=tuple(FP8), window_size="3,0"))
    pos = torch.arange(12)
    flash = (pos[:, None] - pos[None, :] <= 3) & (pos[:, None] >= pos[None, :])
    assert torch.equal(_allowed(pos, pos, hf.sliding_window), flash)


@pytest.mark.parametrize("flags, flag", [
    (dict(softmax_type="off-by-one"), "--softmax-type"),
    (dict(glu_linear_offset=0.5), "--glu-linear-offset"),
    (dict(window_size="127,4"), "--window-size"),
    (dict(moe_layer_freq=2), "--moe-layer-freq"),
    (dict(rotary_percent=0.5), "--rotary-percent"),
])
def test_unrepresentable_values_are_declined_with_one_line(flags, flag):
    with pytest.raises(UsageError) as info:
        translate_megatron(edit_flags(LINE, drop=tuple(FP8), **flags))
    assert [m for m in info.value.messages if m.startswith(flag + ":")], info.value.messages
    assert all("\n" not in m and " — " in m for m in info.value.messages)


def test_yarn_flags_give_gpt_oss_yarn():
    argv = edit_flags(LINE, drop=tuple(FP8) + ("--rope-type",), position_embedding_type="yarn", rotary_base=150000,
                 rotary_scaling_factor=32.0, yarn_original_max_position_embeddings=4096)
    _, hf = _hf_config(argv + ["--no-yarn-correction-range-round-to-int"])
    rope = hf.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]) == \
        ("yarn", 32.0, 4096, 150000.0)
    assert rope["truncate"] is False and rope["beta_fast"] == 32.0 and rope["beta_slow"] == 1.0


def test_line_minus_fp8_trains(tmp_path):
    """The line minus its FP8 flags, sizes shrunk, pipeline/batch/iterations fitted to 1 CPU process: a GPT-OSS
    trains 2 steps with every gpt-oss flag of the line."""
    argv = edit_flags(LINE, drop=tuple(FP8) + ("--save", "--tensorboard-dir", "--train-samples", "--lr-decay-samples",
                                          "--lr-warmup-fraction"),
                 num_layers=2, hidden_size=32, ffn_hidden_size=16, moe_ffn_hidden_size=16, num_attention_heads=4,
                 num_query_groups=2, seq_length=32, max_position_embeddings=64, window_size="7,0",
                 pipeline_model_parallel_size=1, global_batch_size=2, save_interval=2, train_iters=2,
                 lr_decay_iters=2, lr_warmup_iters=0, tokenizer_type="NullTokenizer", vocab_size=128)
    losses, log = run_pretrain(argv, tmp_path / "ckpt")
    assert sorted(losses) == [1, 2], log[-3000:]
    assert all(float(loss) > 0 for _, loss in losses.values())


def test_disable_bias_linear_is_megatrons_bias_free_gpt_oss():
    """--disable-bias-linear: the expert and router biases transformers' GPT-OSS always has are zero and frozen —
    after an optimizer step too — and the model computes what transformers' GPT-OSS computes with those zeros."""
    from transformers import GptOssForCausalLM

    from fsdp2_backend.models.gpt_oss.modeling import build_gpt_oss

    _, hf_config = _hf_config(edit_flags(LINE, drop=tuple(FP8), num_layers=2, hidden_size=32, moe_ffn_hidden_size=16,
                                    num_attention_heads=4, num_query_groups=2, window_size="3,0",
                                    attention_dropout=0, vocab_size=64, tokenizer_type="NullTokenizer"))
    torch.manual_seed(0)
    model = build_gpt_oss(hf_config)
    model.apply(model._init_weights)
    biases = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert sorted(biases) == sorted(f"model.layers.{i}.mlp.{n}" for i in range(2) for n in
                                    ("experts.gate_up_proj_bias", "experts.down_proj_bias", "router.bias"))
    ids = torch.randint(0, 64, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2).step()
    assert all(p.abs().max() == 0 for n, p in model.named_parameters() if n in biases)
    hf_config._attn_implementation = "eager"
    reference = GptOssForCausalLM(hf_config)
    missing, _ = reference.load_state_dict(model.state_dict(), strict=False)  # ours has router buffers besides
    assert not missing
    model.eval(), reference.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_tensor_parallel_is_declined_with_its_reason():
    from fsdp2_backend.config import validation

    fields = translate_megatron(edit_flags(LINE, drop=tuple(FP8), tensor_model_parallel_size=2,
                                      pipeline_model_parallel_size=1, global_batch_size=4)).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    with pytest.raises(UsageError) as info:
        validation.validate(config, 2)
    assert any(m.startswith("parallel.tp_size: gpt_oss's attention sinks") for m in info.value.messages), \
        info.value.messages
