"""The Mamba-3 model (`fsdp2_backend.models.mamba3`): the mixer against a token-by-token transcription of
mamba_ssm's step references (SISO `mamba3_siso_step_ref`, MIMO `mamba3_MIMO_step_ref`) driven by the mixer's
own parameters; packed rows equal separate runs; the chunk size changes nothing; every config field is read
(MindSpeed's Mamba-2 style config.json too); save_pretrained / AutoModelForCausalLM round trip; the
`use_triton_rmsnormgated` swap; TP / CP declined.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.models.mamba3.modeling import Mamba3Config, Mamba3ForCausalLM
from fsdp2_backend.models.registry import model_spec
from tests.support.kernel_references import sequential_oracle
from tests.support.tiny_models import tiny_mamba3_config


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = Mamba3ForCausalLM(tiny_mamba3_config(**overrides))
    with torch.no_grad():  # move the parameters off their initial constants so every path matters
        for name, p in model.named_parameters():
            if not name.endswith("in_proj.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def stepwise_mixer(mixer, u, doc_start=None):
    """mamba_ssm's step semantics, per token (the recurrence itself: the scan test's oracle), in float64."""
    m = mixer
    u = u.double()
    b, l, _ = u.shape
    H, P, N, G, R = m.nheads, m.headdim, m.d_state, m.ngroups, m.rank
    proj = u @ m.in_proj.weight.double().T
    z, x, B, C, dd_dt, dd_A, trap, ang = torch.split(proj, m.split, dim=-1)
    A = torch.clamp(-F.softplus(dd_A), max=-m.A_floor)
    dt = F.softplus(dd_dt + m.dt_bias.double())
    B = _norm(B.view(b, l, R, G, N), m.B_norm.weight.double(), 1e-5)
    C = _norm(C.view(b, l, R, G, N), m.C_norm.weight.double(), 1e-5)
    head_group = torch.arange(H) // (H // G)
    k = B[:, :, :, head_group] + m.B_bias.double().permute(1, 0, 2)
    q = C[:, :, :, head_group] + m.C_bias.double().permute(1, 0, 2)
    x = x.view(b, l, H, P)
    z = z.view(b, l, H, P)
    if m.is_mimo:
        v = torch.einsum("blhp,hrp->blrhp", x, m.mimo_x.double())
        zr = torch.einsum("blhp,hrp->blrhp", z, m.mimo_z.double())
    else:
        v, zr = x[:, :, None], z[:, :, None]
    angles = ang[:, :, None, :].expand(b, l, H, ang.shape[-1])
    y = sequential_oracle(q, k, v, A * dt, dt, trap, angles, doc_start=doc_start).double()
    y = y + m.D.double()[:, None] * v
    if m.is_outproj_norm:
        y = _norm(y, m.norm.weight.double().view(H, P), m.norm.variance_epsilon) * F.silu(zr)
    else:
        y = y * F.silu(zr)
    y = torch.einsum("blrhp,hrp->blhp", y, m.mimo_o.double()) if m.is_mimo else y[:, :, 0]
    return y.reshape(b, l, H * P) @ m.out_proj.weight.double().T


@pytest.mark.parametrize("mimo,outproj_norm", [(False, False), (False, True), (True, False), (True, True)])
def test_mixer_equals_stepwise_reference(mimo, outproj_norm):
    model = _model(is_mimo=mimo, mimo_rank=2, is_outproj_norm=outproj_norm, chunk_size=4 if mimo else 8)
    mixer = model.model.layers[0].mamba
    u = torch.randn(2, 19, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mixer(u).double(), stepwise_mixer(mixer, u), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mimo", [False, True])
def test_packed_rows_equal_separate_documents(mimo):
    model = _model(is_mimo=mimo, mimo_rank=2, chunk_size=4)
    lengths = [7, 3, 10]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    packed = model(input_ids=ids, position_ids=position_ids).logits
    separate, start = [], 0
    for n in lengths:
        separate.append(model(input_ids=ids[:, start:start + n]).logits)
        start += n
    torch.testing.assert_close(packed, torch.cat(separate, dim=1), rtol=1e-5, atol=1e-5)
    # a batch of two packed rows, each with its own boundaries, equals the rows run one at a time
    ids2 = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    pos2 = torch.stack([position_ids[0], torch.cat([torch.arange(12), torch.arange(8)])])
    both = model(input_ids=ids2, position_ids=pos2).logits
    for row in range(2):
        torch.testing.assert_close(both[row:row + 1], model(input_ids=ids2[row:row + 1],
                                                            position_ids=pos2[row:row + 1]).logits,
                                   rtol=1e-5, atol=1e-5)


def test_chunk_size_changes_nothing_and_padding_is_refused():
    ids = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(4))
    ref = _model(chunk_size=64)(input_ids=ids).logits
    for chunk in (1, 5, 8):
        torch.testing.assert_close(_model(chunk_size=chunk)(input_ids=ids).logits, ref, rtol=1e-5, atol=1e-5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="padded batches"):
        _model()(input_ids=ids, attention_mask=mask)


def test_every_size_comes_from_the_config():
    cfg = tiny_mamba3_config(expand=3, head_dim=12, n_groups=4, state_size=20, rope_fraction=1.0, is_mimo=True,
                      mimo_rank=3, use_bias=True, is_outproj_norm=True, num_hidden_layers=3,
                      tie_word_embeddings=True)
    model = Mamba3ForCausalLM(cfg)
    mixer = model.model.layers[0].mamba
    assert len(model.model.layers) == 3 and model.lm_head.weight is model.model.embed_tokens.weight
    assert (mixer.nheads, mixer.headdim, mixer.rank, mixer.num_rope_angles) == (8, 12, 3, 10)
    # [z, x, B, C, dt, A, trap, angles] = 2·96 + 2·20·4·3 + 3·8 + 10
    assert mixer.in_proj.weight.shape == (2 * 96 + 2 * 20 * 4 * 3 + 3 * 8 + 10, 32)
    assert mixer.in_proj.bias is not None and mixer.out_proj.bias is not None
    assert mixer.mimo_x.shape == (8, 3, 12) and mixer.norm.group_size == 12
    with pytest.raises(ValueError, match="num_heads"):
        tiny_mamba3_config(num_heads=5)
    with pytest.raises(ValueError, match="disagrees"):
        Mamba3Config(d_model=64, hidden_size=32)
    with pytest.raises(ValueError, match="silu"):
        tiny_mamba3_config(hidden_act="gelu")


def test_time_step_limit_and_residual_dtype_are_honoured():
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    base = _model()(input_ids=ids).logits
    assert not torch.allclose(_model(time_step_limit=(0.0, 0.01))(input_ids=ids).logits, base)
    bf16 = _model(residual_in_fp32=False).to(torch.bfloat16)(input_ids=ids).logits
    assert bf16.dtype == torch.bfloat16


def test_mindspeed_mamba2_style_config_json_builds_through_the_registry(tmp_path):
    from transformers import AutoConfig

    # the keys MindSpeed's mamba3 checkpoints carry: transformers' Mamba-2 config plus its Mamba-3 additions
    fields = dict(model_type="mamba2", hidden_size=48, num_hidden_layers=2, state_size=16, head_dim=8,
                  num_heads=12, n_groups=3, expand=2, vocab_size=50, chunk_size=4, conv_kernel=4,
                  time_step_rank=3, layer_norm_epsilon=1e-6, is_mimo=True, mimo_rank=2, d_model=48, n_layer=2,
                  d_state=16, headdim=8, rms_norm_eps=1e-6)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    hf_config = AutoConfig.from_pretrained(tmp_path)
    model = model_spec("mamba3").build(hf_config)
    mixer = model.model.layers[1].mamba
    assert (mixer.nheads, mixer.ngroups, mixer.rank, mixer.chunk_size) == (12, 3, 2, 4)
    assert model.model.norm_f.variance_epsilon == 1e-6 and model.lm_head.weight.shape == (50, 48)
    ids = torch.randint(0, 50, (2, 9))
    assert model(input_ids=ids).logits.shape == (2, 9, 50)


def test_save_pretrained_round_trip_through_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _model(is_mimo=True, mimo_rank=2, is_outproj_norm=True)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "mamba3"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is Mamba3ForCausalLM and isinstance(AutoConfig.from_pretrained(tmp_path), Mamba3Config)
    ids = torch.randint(0, 97, (2, 13))
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_seeded_init_is_mamba_ssms():
    from fsdp2_backend.models.loading import seeded_initialize

    model = Mamba3ForCausalLM(tiny_mamba3_config(is_mimo=True, mimo_rank=2, time_step_min=0.01, time_step_max=0.05))
    seeded_initialize(model, seed=3)
    mixer = model.model.layers[0].mamba
    dt = F.softplus(mixer.dt_bias)
    assert bool((dt >= 0.01 - 1e-6).all() and (dt <= 0.05 + 1e-6).all())
    assert bool((mixer.B_bias == 1).all() and (mixer.D == 1).all() and (mixer.mimo_x == 0.5).all())
    assert abs(model.lm_head.weight.std().item() - 0.02) < 0.005


def test_use_triton_rmsnormgated_switches_the_gated_norms():
    from fsdp2_backend.config import OptimizationArguments
    from fsdp2_backend.parallel.kernel_swaps import apply_fused_ops

    model = _model(is_outproj_norm=True)
    ids = torch.randint(0, 97, (2, 10))
    before = model(input_ids=ids).logits
    lines = []
    apply_fused_ops(model, OptimizationArguments(use_triton_rmsnormgated=True), "cpu", log=lines.append)
    assert lines == ["use_triton_rmsnormgated: no fused kernel on cpu — running the torch reference "
                     "(6 gated RMSNorm modules of Mamba3ForCausalLM)"]
    norms = [m for m in model.modules() if type(m).__name__ == "Mamba3RMSNormGated"]
    assert len(norms) == 6 and all(m.use_kernel for m in norms)
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)


@pytest.mark.parametrize("flag", ["tp_size", "cp_size"])
def test_tensor_and_context_parallel_are_declined(flag):
    from fsdp2_backend.config.rules.parallel import check_model_layout
    from fsdp2_backend.config.model_facts import ModelFacts
    from fsdp2_backend.config.schema import Config

    config = Config()
    config.model.model_id = "mamba3"
    setattr(config.parallel, flag, 2)
    errors = []
    check_model_layout(config, ModelFacts(source=""), 4, errors)
    assert errors == [f"parallel.{flag}: model_id mamba3 runs with FSDP only — tensor and context parallel are "
                      f"not built for its scan; use tp_size 1 and cp_size 1"]
