"""Megatron's hybrid Mamba flags (`--hybrid-layer-pattern`, megatron-lm's examples/mamba/train.sh) build
transformers' NemotronH (`megatron_compat.architecture.hybrid`): the corpus line translates, the built config's
layer kinds are the pattern's, the sizes are Megatron's, what NemotronH cannot represent is declined with one
line, the Mamba mixer runs Megatron's step-size rule (no dt clamp; `models/nemotron_h.py`) against a sequential
Mamba-2 recurrence written here from the Mamba-2 equations, and a scaled-down copy of the line trains on CPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron_compat.translate import translate_megatron, translate_report
from tests.support.launchers import run_pretrain

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json").read_text())
LINE = CORPUS["megatron-lm:examples/mamba/train.sh"]


def _arch(argv):
    return translate_megatron(argv).fields["model"]["architecture"]


def _set(argv, flag, value=None):
    """`argv` with `flag`'s value replaced (or the flag removed when value is None)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == flag:
            i += 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
            if value is not None:
                out += [flag, value]
            continue
        out.append(argv[i])
        i += 1
    return out


def test_corpus_line_translates_to_nemotron_h_with_the_pattern_and_megatron_sizes():
    from transformers import NemotronHConfig

    pattern = LINE[LINE.index("--hybrid-layer-pattern") + 1]
    arch = _arch(LINE)
    config = NemotronHConfig(**{k: v for k, v in arch.items() if k != "model_type"})
    assert config.hybrid_override_pattern == pattern  # NemotronH's own letters: M * - E
    assert config.num_hidden_layers == len(pattern) == 56
    h = 4096
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        h, 32, 8, h // 32)
    # Megatron's defaults: ffn 4h, gelu MLP, Mamba-2 state 128, head dim 64, 8 groups, expand 2, conv 4, chunk 128
    assert (config.intermediate_size, config.mlp_hidden_act) == (4 * h, "gelu")
    assert (config.ssm_state_size, config.mamba_head_dim, config.n_groups, config.mamba_num_heads) == (
        128, 64, 8, 2 * h // 64)
    assert (config.conv_kernel, config.chunk_size, config.use_conv_bias, config.use_bias, config.mlp_bias) == (
        4, 128, True, False, False)
    assert (config.layer_norm_epsilon, config.tie_word_embeddings, config.initializer_range) == (1e-5, False, 0.02)
    assert tuple(config.time_step_limit) == (0.0, float("inf"))


@pytest.mark.parametrize("flag,value,named", [
    ("--hybrid-layer-pattern", "M*ME-", "--hybrid-layer-pattern"),  # MoE layers
    ("--hybrid-layer-pattern", "M*M-/*-", "--hybrid-layer-pattern"),  # MTP part
    ("--position-embedding-type", "rope", "--position-embedding-type"),
    ("--swiglu", None, "--swiglu"),
    ("--norm-epsilon", "1e-6", "--norm-epsilon"),
    ("--num-layers", "7", "--num-layers"),
    ("--qk-layernorm", None, "--qk-layernorm"),
])
def test_what_nemotron_h_cannot_represent_is_declined_with_one_line(flag, value, named):
    argv = LINE + [flag] + ([value] if value is not None else [])
    if flag == "--hybrid-layer-pattern":
        argv = _set(LINE, flag, value)
    declined = dict(translate_report(argv).report.declined)
    assert list(declined) == [named], declined
    assert " — " in declined[named]


def test_pipeline_separators_and_explicit_sizes():
    argv = _set(_set(LINE, "--hybrid-layer-pattern", "M-*|M-*"), "--hidden-size", "64")
    arch = _arch(argv + ["--num-layers", "6", "--mamba-num-heads", "6", "--mamba-head-dim", "16",
                         "--mamba-num-groups", "2", "--mamba-state-dim", "32", "--squared-relu", "--ffn-hidden-size",
                         "96", "--kv-channels", "16"])
    assert arch["layers_block_type"] == ["linear_attention", "mlp", "full_attention"] * 2
    assert (arch["mamba_num_heads"], arch["mamba_head_dim"], arch["n_groups"], arch["ssm_state_size"]) == (
        6, 16, 2, 32)
    assert (arch["mlp_hidden_act"], arch["intermediate_size"], arch["head_dim"]) == ("relu2", 96, 16)


def _sequential_mamba2(mixer, x):
    """Megatron's Mamba-2 mixer (megatron-core `ssm/mamba_mixer.py`) one time step at a time: in_proj → z, xBC, dt;
    causal depthwise conv + SiLU on xBC; dt = softplus(dt + dt_bias) with no clamp; h = exp(dt A) h + dt x B^T;
    y = h C + D x; then RMSNorm over each group of y * silu(z) (norm after the gate), out_proj."""
    heads, p, g, n = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    d_inner = heads * p
    z, xbc, dt = mixer.in_proj(x).split([d_inner, d_inner + 2 * g * n, heads], dim=-1)
    width = mixer.conv1d.weight.shape[-1]
    padded = F.pad(xbc.transpose(1, 2), (width - 1, 0))
    conv = torch.stack([(padded[:, :, t:t + width] * mixer.conv1d.weight[:, 0]).sum(-1) for t in range(x.shape[1])],
                       dim=1) + mixer.conv1d.bias
    xs, B, C = F.silu(conv).split([d_inner, g * n, g * n], dim=-1)
    dt = F.softplus(dt + mixer.dt_bias)
    A = -torch.exp(mixer.A_log)
    state = torch.zeros(x.shape[0], heads, p, n)
    ys = []
    for t in range(x.shape[1]):
        xt = xs[:, t].view(-1, heads, p)
        bt = B[:, t].view(-1, g, n).repeat_interleave(heads // g, dim=1)
        ct = C[:, t].view(-1, g, n).repeat_interleave(heads // g, dim=1)
        state = torch.exp(dt[:, t] * A)[..., None, None] * state + (dt[:, t, :, None] * xt)[..., None] * bt[:, :, None]
        ys.append((state * ct[:, :, None]).sum(-1) + mixer.D[:, None] * xt)
    y = torch.stack(ys, dim=1).reshape(x.shape[0], x.shape[1], d_inner) * F.silu(z)
    grouped = y.view(*y.shape[:-1], g, d_inner // g)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon)
    return mixer.out_proj(grouped.view_as(y) * mixer.norm.weight)


def test_mamba_mixer_runs_megatrons_unclamped_step_size():
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2_backend.models.nemotron_h import honour_time_step_limit

    argv = _set(_set(_set(LINE, "--hybrid-layer-pattern", "M*-"), "--hidden-size", "32"), "--num-attention-heads", "4")
    arch = _arch(argv + ["--num-query-groups", "2", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
                         "--mamba-state-dim", "8", "--mamba-chunk-size", "4"])
    arch["vocab_size"] = 64
    config = AutoConfig.for_model(**arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mixer = model.model.layers[0].mixer
    with torch.no_grad():
        mixer.in_proj.weight.normal_(0, 1)
        mixer.out_proj.weight.normal_(0, 0.3)
        mixer.dt_bias.fill_(-9.0)  # softplus ≈ 1.2e-4: below time_step_min 0.001, where a clamp would bite
        mixer.dt_bias[::2] = 0.5
        mixer.D.zero_()  # the state's output alone, so the step size decides it
    x = torch.randn(2, 10, 32)
    expected = _sequential_mamba2(mixer, x)
    assert expected.abs().max() > 0.1
    as_built = mixer(x)
    # transformers < 5.25 as built: dt clamped at time_step_min 0.001; 5.25 reads the config's time_step_limit itself
    if tuple(mixer.time_step_limit) != tuple(config.time_step_limit):
        assert (as_built - expected).abs().max() > 1e-2
    honour_time_step_limit(model, log=lambda line: None)
    for training in (True, False):  # the fused-path fallback and the chunked torch path
        mixer.train(training)
        torch.testing.assert_close(mixer(x), expected, atol=2e-5, rtol=1e-4)


def test_scaled_down_corpus_line_trains_two_steps_on_one_cpu_rank(tmp_path):
    argv = _set(LINE, "--hybrid-layer-pattern", "M-M*-M")
    for flag, value in (("--hidden-size", "32"), ("--num-attention-heads", "4"), ("--num-query-groups", "2"),
                        ("--seq-length", "32"), ("--max-position-embeddings", "32"), ("--micro-batch-size", "2"),
                        ("--global-batch-size", "2"), ("--tensor-model-parallel-size", "1"),
                        ("--train-samples", "4"), ("--lr-warmup-samples", "0"), ("--lr-decay-samples", "4"),
                        ("--log-interval", "1"), ("--eval-iters", "0"), ("--save-interval", "100"),
                        ("--save", None), ("--load", None), ("--data-path", None), ("--data-cache-path", None),
                        ("--split", None), ("--tokenizer-model", None), ("--tokenizer-type", "NullTokenizer"),
                        ("--tensorboard-dir", None), ("--sequence-parallel", None), ("--bf16", None),
                        ("--distributed-backend", "gloo")):
        argv = _set(argv, flag, value)
    argv += ["--mamba-head-dim", "8", "--mamba-num-groups", "2", "--mamba-state-dim", "8", "--mamba-chunk-size", "8",
             "--mock-data", "--vocab-size", "127"]
    losses, log = run_pretrain(argv, tmp_path / "run")
    assert sorted(losses) == [1, 2], log[-2000:]
    config = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    # Megatron's unclamped step size, in the config (transformers >= 5.25's mixer reads it; before, the run set it
    # on each mixer and said so)
    from transformers import AutoConfig
    assert tuple(AutoConfig.from_pretrained(tmp_path / "run" / "hf").time_step_limit) == (0.0, float("inf"))
    assert config["model_type"] == "nemotron_h"
    assert [c for c in config["layers_block_type"]] == ["linear_attention", "mlp", "linear_attention",
                                                         "full_attention", "mlp", "linear_attention"]


def test_the_lines_tensor_parallel_is_declined_in_one_line():
    from fsdp2_backend.config import GROUPS, Config
    from fsdp2_backend.config import validation as config_validation
    from fsdp2_backend.usage_errors import UsageError

    fields = translate_megatron(LINE).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    assert config.parallel.tp_size == 4
    with pytest.raises(UsageError) as exc:
        config_validation.validate(config, 4)
    assert [m for m in exc.value.messages if "nemotron_h" in m] == [
        "parallel.tp_size: model_type nemotron_h (a hybrid Mamba stack) has no tensor-parallel plan for its Mamba "
        "mixers — use tp_size 1 (FSDP)"]
