"""MLA's YaRN flags build transformers' DeepSeek-V3 with megatron-core's rotary embedding and softmax scale.

Reference: megatron-core 0.16.1's YaRN helpers (`yarn_rotary_pos_embedding`: correction range, linear ramp,
concentration factor, mscale) and `MLASelfAttention`'s softmax scale formula, against the rotary embedding and
attention of the transformers model the translated config builds.
"""
import math

import pytest
import torch

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.models.loading import load_hf_config
from megatron_compat.translate import translate_megatron

MLA = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 256 "
       "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --mock-data "
       "--tokenizer-type NullTokenizer --vocab-size 100 --position-embedding-type rope --normalization RMSNorm "
       "--swiglu --disable-bias-linear --hidden-dropout 0 --multi-latent-attention --q-lora-rank 32 "
       "--kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16").split()


def _model(argv):
    from transformers import AutoModelForCausalLM

    fields = translate_megatron(argv).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    hf_config = load_hf_config(config.model)
    assert hf_config.model_type == "deepseek_v3"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config)


def _megatron_yarn(dim, base, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim):
    """megatron-core's YarnRotaryEmbedding.get_emb inverse frequencies and concentration factor (its helpers;
    get_emb itself moves tensors to CUDA)."""
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as y

    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = y._yarn_find_correction_range(beta_fast, beta_slow, dim, base, original, True)
    mask = 1.0 - y._yarn_linear_ramp_mask(low, high, dim // 2, device=torch.device("cpu")).float()
    inv_freq = inter * (1 - mask) + extra * mask
    return inv_freq, y._yarn_get_concentration_factor(factor, mscale, mscale_all_dim), y._yarn_get_mscale


@pytest.mark.parametrize("flags, expect", [
    # Megatron-LM spelling (the deepseek proxy functional test), mscale_all_dim 0 by default
    ("--rotary-scaling-factor 40 --mscale 0.707", dict(factor=40.0, mscale=0.707, mscale_all_dim=0.0,
                                                      beta_fast=32.0, beta_slow=1.0, original=4096)),
    # MindSpeed-LLM spelling (its DeepSeek-V2-Lite / V3 scripts)
    ("--rope-scaling-type yarn --rope-scaling-factor 40 --rope-scaling-mscale 0.707 "
     "--rope-scaling-mscale-all-dim 0.707 --rope-scaling-original-max-position-embeddings 64 --beta-fast 32 "
     "--beta-slow 1", dict(factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0,
                           original=64)),
])
def test_yarn_flags_give_megatrons_rotary_embedding_and_softmax_scale(flags, expect):
    model = _model(MLA + flags.split())
    rotary = model.model.rotary_emb
    base = model.config.rope_parameters["rope_theta"]
    reference, concentration, get_mscale = _megatron_yarn(
        8, base, expect["factor"], expect["original"], expect["beta_fast"], expect["beta_slow"], expect["mscale"],
        expect["mscale_all_dim"])
    torch.testing.assert_close(rotary.inv_freq, reference, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(concentration, rel=1e-12)
    # MLASelfAttention: softmax_scale = mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim)
    softmax_scale = get_mscale(expect["factor"], expect["mscale_all_dim"]) ** 2 / math.sqrt(16 + 8)
    assert model.model.layers[0].self_attn.scaling == pytest.approx(softmax_scale, rel=1e-12)
    # the flags took effect: plain RoPE would have the extrapolated frequencies everywhere
    plain = 1.0 / (base ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    assert not torch.allclose(rotary.inv_freq, plain)
    # and the model runs (the rotary width is qk_pos_emb_head_dim, not hidden / heads)
    logits = model(torch.randint(0, 100, (1, 12))).logits
    assert logits.shape == (1, 12, 100) and torch.isfinite(logits).all()


def test_yarn_flags_are_reported_mapped_and_plain_mla_stays_plain_rope():
    report = translate_megatron(MLA + "--rotary-scaling-factor 4 --mscale-all-dim 1.0".split())
    arch = report.fields["model"]["architecture"]
    assert arch["rope_scaling"]["rope_type"] == "yarn" and arch["rope_scaling"]["factor"] == 4.0
    assert "rope_scaling" not in translate_megatron(MLA).fields["model"]["architecture"]
    # --kv-channels sets no head width under MLA (Megatron reads the qk / v head dims): reported, not mapped
    from megatron_compat.translate import translate_report

    report = translate_report(MLA + ["--kv-channels", "32"]).report
    assert "--kv-channels" in report.no_effect and "--kv-channels" not in dict(report.mapped)
    assert "head_dim" not in translate_megatron(MLA + ["--kv-channels", "32"]).fields["model"]["architecture"]


def test_yarn_flags_without_mla_are_still_declined():
    from fsdp2_backend.usage_errors import UsageError

    argv = [a for a in MLA if a != "--multi-latent-attention"]
    argv = [a for i, a in enumerate(argv) if not (a.startswith("--q-") or a.startswith("--kv-") or a.startswith(
        "--qk-") or a.startswith("--v-head")) and not (i and argv[i - 1][:5] in ("--q-l", "--kv-", "--qk-", "--v-h"))]
    with pytest.raises(UsageError) as err:
        translate_megatron(argv + "--rotary-scaling-factor 40".split())
    assert any(m.startswith("--rotary-scaling-factor:") for m in err.value.messages)


def test_mla_without_qk_layernorm_says_the_latent_norms_are_there():
    """megatron-core's MLA without --qk-layernorm has no q/kv latent norms (its layer spec leaves them out);
    transformers' DeepSeek-V3 always has them: the run says so once, and with the flag says nothing."""
    from megatron_compat.translate import translate_report

    without = [w for w in translate_report(list(MLA)).report.warnings if "--qk-layernorm" in w]
    assert len(without) == 1 and "latent norms" in without[0], without
    assert not [w for w in translate_report([*MLA, "--qk-layernorm"]).report.warnings if "--qk-layernorm" in w]
