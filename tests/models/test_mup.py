"""Megatron-LM's µP (`--use-mup`, `--mup-*`): attention scale, logit / embedding multipliers, init, Adam groups.

References are written here from megatron-core's formulas (TransformerConfig.__post_init__, utils.
mup_scaled_init_method_normal, optimizer.get_mup_config_overrides; µP is not in megatron-core 0.16.1, the
installed reference): width m = hidden / base, softmax scale 1/d, logits × 1/m, init σ/√m for matrices,
σ/(√(2L)√m) for output projections, σ for embeddings and the untied output layer, Adam lr / min_lr / eps ÷ m for
matrices outside the embeddings and the output layer.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch

from fsdp2_backend.config import Config, ModelArguments
from fsdp2_backend.config.mup_rules import mup_errors
from fsdp2_backend.models.mup import apply_mup
from fsdp2_backend.training.optimizer import build_optimizer
from megatron_compat.translate import translate_megatron
from tests.support.launchers import run_pretrain
from tests.support.tiny_models import tiny_qwen3_config

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json").read_text())
LINE = CORPUS["megatron-lm:tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp1_pp1_mup/model_config.yaml"]


def _model(seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_qwen3_config(**overrides)).eval()


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def test_attention_uses_the_mup_softmax_scale_one_over_d():
    model = _model()
    apply_mup(model, ModelArguments(use_mup=True, mup_base_hidden_size=32), model.config, seed=0, initialise=False)
    attn, d = model.model.layers[0].self_attn, 16
    torch.manual_seed(1)
    x = torch.randn(1, 7, 64)
    positions = torch.arange(7)[None]
    cos, sin = model.model.rotary_emb(x, positions)
    with torch.no_grad():
        out, _ = attn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)
        q = attn.q_norm(attn.q_proj(x).view(1, 7, 4, d)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(1, 7, 2, d)).transpose(1, 2)
        v = attn.v_proj(x).view(1, 7, 2, d).transpose(1, 2)
        q, k = _rotate(q, cos[:, None], sin[:, None]), _rotate(k, cos[:, None], sin[:, None])
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        causal = torch.ones(7, 7, dtype=torch.bool).tril()
        outs = {}
        for name, scale in (("mup", 1.0 / d), ("standard", d ** -0.5)):
            scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            outs[name] = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 7, 64))
    torch.testing.assert_close(out, outs["mup"], atol=1e-5, rtol=1e-4)
    assert (out - outs["standard"]).abs().max() > 1e-3  # the reference tells the two scales apart


def test_softmax_scale_with_base_head_dim_and_power():
    model = _model()
    apply_mup(model, ModelArguments(use_mup=True, mup_base_head_dim=4.0, mup_attn_scale_power=0.5), model.config,
              seed=0, initialise=False)
    assert model.model.layers[1].self_attn.scaling == math.sqrt(4.0) / 16 ** 0.5


def test_logits_are_plain_logits_times_the_output_mult_and_embeddings_scaled():
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = _model()
    for args, mult in ((ModelArguments(use_mup=True, mup_base_hidden_size=32, mup_attn_scale_power=0.5), 0.5),
                       (ModelArguments(use_mup=True, mup_base_hidden_size=32, mup_output_mult=0.3,
                                       mup_attn_scale_power=0.5), 0.3)):
        model = copy.deepcopy(plain)
        apply_mup(model, args, model.config, seed=0, initialise=False)  # power 0.5: the standard attention
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits * mult,
                                       atol=1e-6, rtol=1e-5)
    model = copy.deepcopy(plain)
    apply_mup(model, ModelArguments(use_mup=True, mup_embedding_mult=2.5, mup_attn_scale_power=0.5), model.config,
              seed=0, initialise=False)  # width 1: output mult 1
    with torch.no_grad():
        expected = plain(inputs_embeds=plain.model.embed_tokens(ids) * 2.5).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=1e-5)


def _expected_group_values(name, lr, min_lr, eps, m, decoupled=None):
    """Megatron's rules per parameter name: embeddings / output layer (decoupled lr when given) and vectors keep the
    base values; the other matrices get lr / m, min_lr / m, eps / m."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (decoupled if decoupled else lr), min_lr, eps
    if name.endswith(("norm.weight", ".bias")):
        return lr, min_lr, eps
    assert name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                          "up_proj.weight", "down_proj.weight")), name
    return lr / m, min_lr / m, eps / m


def test_adam_groups_follow_megatron_mup_rules_per_parameter():
    lr, min_lr, eps, m = 3e-3, 3e-5, 1e-8, 4.0
    for decoupled in (None, 5e-4):
        model = _model()
        optimizer = build_optimizer(model, lr=lr, weight_decay=0.1, eps=eps, min_lr=min_lr, mup_width_mult=m,
                                    decoupled_lr=decoupled)
        names = {id(p): n for n, p in model.named_parameters()}
        seen = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                got = (group.get("max_lr", lr), group.get("min_lr", min_lr), group["eps"])
                expected = _expected_group_values(names[id(p)], lr, min_lr, eps, m, decoupled)
                assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(got, expected)), (names[id(p)], got)
                seen += 1
        assert seen == len(names)
        assert optimizer.param_groups[0]["lr"] == lr  # the logged lr is the base schedule's
    plain = build_optimizer(_model(), lr=lr, weight_decay=0.1, eps=eps, min_lr=min_lr, mup_width_mult=1.0)
    assert all("max_lr" not in g and g["eps"] == eps for g in plain.param_groups)  # m = 1: Megatron overrides none


def test_mup_init_stds():
    sigma, m, layers = 0.02, 4.0, 2
    model = _model(hidden_size=128, intermediate_size=256, head_dim=32, initializer_range=sigma)
    apply_mup(model, ModelArguments(use_mup=True, mup_base_hidden_size=32), model.config, seed=3, initialise=True)
    expected = {"model.embed_tokens.weight": sigma, "lm_head.weight": sigma}
    for i in range(layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            expected[f"model.layers.{i}.{name}.weight"] = sigma / math.sqrt(m)
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            expected[f"model.layers.{i}.{name}.weight"] = sigma / (math.sqrt(2 * layers) * math.sqrt(m))
    params = dict(model.named_parameters())
    for name, std in expected.items():
        w = params[name].detach()
        tolerance = 4 / math.sqrt(2 * w.numel())  # four standard errors of a sample std, relative
        assert abs(w.std().item() / std - 1) < tolerance, (name, w.std().item(), std)
        assert abs(w.mean().item()) < 4 * std / math.sqrt(w.numel()), name
    assert torch.equal(params["model.norm.weight"], torch.ones(128))  # vectors keep their init


def test_corpus_line_translates():
    translation = translate_megatron(LINE)
    model = translation.fields["model"]
    assert model["use_mup"] is True and model["mup_base_hidden_size"] == 256
    mapped = dict(translation.report.mapped)
    assert mapped["--use-mup"] == "model.use_mup" and mapped["--mup-base-hidden-size"] == "model.mup_base_hidden_size"


def test_what_cannot_be_honoured_is_declined_in_one_line():
    config = Config()
    config.model.mup_base_hidden_size = 32
    assert mup_errors(config, None) == ["model.mup_base_hidden_size: only read with model.use_mup (--use-mup) — set "
                                        "use_mup, or unset mup_base_hidden_size"]
    config.model.use_mup, config.training.optimizer = True, "muon"
    (error,) = mup_errors(config, None)
    assert error.startswith("model.use_mup (--use-mup): µP's learning-rate rules are implemented for Adam only")


def _set(argv, flag, value=None):
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


def test_scaled_down_corpus_line_trains_two_steps_on_one_cpu_rank(tmp_path):
    argv = LINE
    for flag, value in (("--num-layers", "2"), ("--hidden-size", "64"), ("--num-attention-heads", "4"),
                        ("--mup-base-hidden-size", "32"), ("--seq-length", "32"), ("--max-position-embeddings", "32"),
                        ("--micro-batch-size", "2"), ("--global-batch-size", "2"), ("--train-iters", "2"),
                        ("--eval-iters", "0"), ("--save", None), ("--load", None), ("--data-path", None),
                        ("--vocab-file", None), ("--merge-file", None), ("--data-cache-path", None), ("--split", None),
                        ("--tensorboard-dir", None), ("--bf16", None), ("--distributed-backend", "gloo")):
        argv = _set(argv, flag, value)
    # tied, as the line builds it (a tied GPT-2: the FSDP plan leaves the tied pair to the root)
    argv += ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127"]
    losses, log = run_pretrain(argv, tmp_path / "run")
    assert sorted(losses) == [1, 2], log[-2000:]
    assert all(math.isfinite(float(loss)) for _, loss in losses.values())


def test_chunked_loss_sees_the_output_mult():
    """The chunked loss swaps the lm head's forward; the multiplier (a pre-hook on its input) still applies."""
    import torch.nn.functional as F

    from fsdp2_backend.training.chunked_forward import chunked_loss_forward

    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 9)
    plain = _model()
    model = copy.deepcopy(plain)
    apply_mup(model, ModelArguments(use_mup=True, mup_base_hidden_size=16, mup_attn_scale_power=0.5), model.config,
              seed=0, initialise=False)  # output mult 1/4
    with torch.no_grad():
        loss_sum, count, _ = chunked_loss_forward(model, ids, None, labels, mask, chunk_size=5)
        logits = plain(input_ids=ids).logits * 0.25
        expected = F.cross_entropy(logits.reshape(-1, 512), labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(loss_sum, expected, atol=1e-4, rtol=1e-5)
    assert count.item() == 18
