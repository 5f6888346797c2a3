"""Released MTP layouts (models/mtp_layouts.py): a tiny checkpoint written here in the published key layout with
random tensors loads into our MTP modules where the reference mapping below (written from the published layout,
not from the code under test) says; the logged MTP loss equals a hand-computed reference in plain torch ops from
those checkpoint tensors; the HF export writes them back under the checkpoint's own names, bit for bit."""
import math

import pytest
import torch
import torch.nn.functional as F

from fsdp2_backend.config import Config

from tests.support.mtp_layouts import (assert_export_round_trip, full_state, mtp_batch, mtp_trainer, partial_rope,
                                       swiglu, zero_centered_rms)


# ----------------------------------------------------------------------------------------------- Qwen3-Next
def _next_config():
    from tests.support.tiny_models import tiny_next_config

    # the last layer is linear attention and dense: the MTP layer must still be full attention with the MoE
    return tiny_next_config(layer_types=["linear_attention", "full_attention", "linear_attention",
                                         "linear_attention"], mlp_only_layers=[3])


def _next_mtp_tensors(cfg, seed=7):
    """Qwen3-Next's published MTP keys (vLLM qwen3_next_mtp.py, the released Qwen3-Next-80B-A3B index), random."""
    gen = torch.Generator().manual_seed(seed)
    h, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inter, shared, experts = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts
    shapes = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
              "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,),
              "mtp.layers.0.input_layernorm.weight": (h,), "mtp.layers.0.post_attention_layernorm.weight": (h,),
              "mtp.layers.0.self_attn.q_proj.weight": (nh * hd * 2, h),
              "mtp.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
              "mtp.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
              "mtp.layers.0.self_attn.o_proj.weight": (h, nh * hd),
              "mtp.layers.0.self_attn.q_norm.weight": (hd,), "mtp.layers.0.self_attn.k_norm.weight": (hd,),
              "mtp.layers.0.mlp.gate.weight": (experts, h),
              "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (shared, h),
              "mtp.layers.0.mlp.shared_expert.up_proj.weight": (shared, h),
              "mtp.layers.0.mlp.shared_expert.down_proj.weight": (h, shared),
              "mtp.layers.0.mlp.shared_expert_gate.weight": (1, h)}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, h)), ("up_proj", (inter, h)), ("down_proj", (h, inter))):
            shapes[f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    return {k: torch.randn(shape, generator=gen) * (0.3 if len(shape) == 1 else 0.15) for k, shape in shapes.items()}


# Where each published key lands among our modules (Megatron's names; the order of the concat is the same:
# embedding first). Per-expert keys are checked separately (stacked gate rows then up rows).
NEXT_REFERENCE = {"mtp.fc.weight": "mtp.layers.0.eh_proj.weight",
                  "mtp.pre_fc_norm_embedding.weight": "mtp.layers.0.enorm.weight",
                  "mtp.pre_fc_norm_hidden.weight": "mtp.layers.0.hnorm.weight",
                  "mtp.norm.weight": "mtp.layers.0.final_layernorm.weight"}


def _next_reference_name(key):
    if key in NEXT_REFERENCE:
        return NEXT_REFERENCE[key]
    return "mtp.layers.0.transformer_layer." + key[len("mtp.layers.0."):]


@pytest.fixture()
def next_dir(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(3)
    cfg = _next_config()
    Qwen3NextForCausalLM(cfg).save_pretrained(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(shard)
    mtp = _next_mtp_tensors(cfg)
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    return tmp_path / "ckpt", mtp


def _next_layer(x, w, pos, cfg):
    """A Qwen3-Next full-attention decoder layer with the sparse MoE, by hand: gated attention (q_proj gives each
    head's query then its gate), per-head zero-centred q/k norms, partial rope; softmax top-k renormalised experts
    plus the sigmoid-gated shared expert."""
    B, S, h = x.shape
    nh, nkv, hd, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    rope = cfg.rope_parameters
    rotary_dim = int(hd * rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)))
    a = zero_centered_rms(x, w["input_layernorm.weight"], eps)
    qg = (a @ w["self_attn.q_proj.weight"].T).view(B, S, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, S, nh * hd)
    q = zero_centered_rms(q, w["self_attn.q_norm.weight"], eps)
    k = zero_centered_rms((a @ w["self_attn.k_proj.weight"].T).view(B, S, nkv, hd), w["self_attn.k_norm.weight"], eps)
    v = (a @ w["self_attn.v_proj.weight"].T).view(B, S, nkv, hd)
    q = partial_rope(q, pos, rope["rope_theta"], rotary_dim).transpose(1, 2)
    k = partial_rope(k, pos, rope["rope_theta"], rotary_dim).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    v = v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                                    float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, nh * hd) * torch.sigmoid(gate)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    m = zero_centered_rms(x, w["post_attention_layernorm.weight"], eps).reshape(B * S, h)
    probs = (m @ w["mlp.gate.weight"].T).softmax(-1)
    top, idx = probs.topk(cfg.num_experts_per_tok, dim=-1)
    top = top / top.sum(-1, keepdim=True)  # norm_topk_prob
    routed = torch.zeros_like(m)
    for t in range(m.size(0)):
        for weight, e in zip(top[t], idx[t].tolist()):
            p = f"mlp.experts.{e}."
            routed[t] += weight * swiglu(m[t], w[p + "gate_proj.weight"], w[p + "up_proj.weight"],
                                          w[p + "down_proj.weight"])
    s = "mlp.shared_expert."
    shared = torch.sigmoid(m @ w["mlp.shared_expert_gate.weight"].T) * swiglu(
        m, w[s + "gate_proj.weight"], w[s + "up_proj.weight"], w[s + "down_proj.weight"])
    return x + (routed + shared).view(B, S, h)


def _next_reference_loss(path, mtp, batch):
    """The depth-1 MTP mean loss from the checkpoint's own tensors, over transformers' own main model."""
    from transformers import Qwen3NextForCausalLM

    main = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = main.config
    ids, labels, mask, pos = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    with torch.no_grad():
        hidden = main.model(input_ids=ids, position_ids=pos).last_hidden_state  # after the final norm
    roll = lambda t: torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1)  # noqa: E731
    ids1, labels1, mask1 = roll(ids), roll(labels), roll(mask)
    emb = main.model.embed_tokens.weight.detach()[ids1]
    eps = cfg.rms_norm_eps
    x = torch.cat([zero_centered_rms(emb, mtp["mtp.pre_fc_norm_embedding.weight"], eps),
                   zero_centered_rms(hidden, mtp["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ mtp["mtp.fc.weight"].T
    layer = {k[len("mtp.layers.0."):]: v for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    x = zero_centered_rms(_next_layer(x, layer, pos, cfg), mtp["mtp.norm.weight"], eps)
    ce = F.cross_entropy((x @ main.lm_head.weight.detach().T).flatten(0, 1), labels1.flatten(), reduction="none")
    return ((ce * mask1.flatten()).sum() / mask1.sum()).item()


# ------------------------------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("model_id", ["qwen3_next", None])
def test_qwen3_next_mtp_keys_land_where_the_published_layout_says(next_dir, model_id):
    path, mtp = next_dir
    trainer, ctx = mtp_trainer(path, model_id)
    try:
        state = full_state(trainer.model)
        layer = trainer.model.mtp.layers[0].transformer_layer
        assert layer.block_type == "full_attention" and hasattr(layer.mlp, "shared_expert_gate")
        if model_id == "qwen3_next":
            from fsdp2_backend.models.moe.experts import GroupedExperts
            from fsdp2_backend.models.qwen3_next.modeling import Qwen3NextRouter

            assert isinstance(layer.mlp.experts, GroupedExperts) and isinstance(layer.mlp.gate, Qwen3NextRouter)
        experts = _next_config().num_experts
        prefix = "mtp.layers.0.transformer_layer.mlp.experts."
        for key, tensor in mtp.items():
            if ".mlp.experts." in key:
                continue
            assert torch.equal(state[_next_reference_name(key)], tensor), key
        for e in range(experts):
            gate, up, down = (mtp[f"mtp.layers.0.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                                        "down_proj"))
            assert torch.equal(state[prefix + "gate_up_proj"][e], torch.cat([gate, up])), e
            assert torch.equal(state[prefix + "down_proj"][e], down), e
        assert trainer.model.config.mtp_num_hidden_layers == 1
    finally:
        ctx.close()


def test_qwen3_next_mtp_loss_equals_a_hand_computed_reference_and_trains(next_dir, capsys):
    from fsdp2_backend.training.logging import parse_train_line
    from fsdp2_backend.training.loss import GlobalBatchLoss

    path, mtp = next_dir
    trainer, ctx = mtp_trainer(path, "qwen3_next")
    try:
        batch = mtp_batch(trainer.model.config.vocab_size)
        reference = _next_reference_loss(path, mtp, batch)
        accounting = GlobalBatchLoss(num_microbatches=1, dp_size=1, calculate_per_token_loss=False)
        with torch.no_grad():
            trainer._forward_loss(batch, accounting)
        assert trainer._finish_mtp(1)["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        trainer.train()  # two steps: the MTP layer (with its experts) trains
        lines = [parse_train_line(line) for line in capsys.readouterr().out.splitlines()]
        first = next(x for x in lines if x and x["iteration"] == 1)
        assert first["losses"]["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        after = full_state(trainer.model)
        for key in ("mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.gate.weight"):
            assert not torch.equal(after[_next_reference_name(key)], mtp[key]), key  # trained
        moved = [not torch.equal(after["mtp.layers.0.transformer_layer.mlp.experts.down_proj"][e],
                                 mtp[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"]) for e in range(4)]
        assert any(moved)  # the routed experts train
    finally:
        ctx.close()


def test_qwen3_next_export_writes_the_published_names_and_reloads_exactly(next_dir, tmp_path):
    from transformers import Qwen3NextForCausalLM

    from fsdp2_backend.checkpoint.hf_export import write_hf_dir

    path, mtp = next_dir
    trainer, ctx = mtp_trainer(path, "qwen3_next")
    try:
        state = full_state(trainer.model)
        write_hf_dir(trainer.model, state, tmp_path / "export")
    finally:
        ctx.close()
    import json

    assert json.loads((tmp_path / "export" / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    Qwen3NextForCausalLM.from_pretrained(tmp_path / "export")  # transformers still reads it (MTP keys ignored)
    assert_export_round_trip(tmp_path / "export", "mtp.", mtp, state, "qwen3_next")


def test_validation_takes_qwen3_next_with_one_depth_only():
    from fsdp2_backend.config.validation import validate

    config = Config()
    config.model.model_id, config.model.mtp_num_layers = "qwen3_next", 2
    with pytest.raises(Exception, match="Qwen3-Next's MTP layout holds one depth"):
        validate(config, world_size=1)
    config.model.model_id = "gpt_oss"
    with pytest.raises(Exception, match="model.model_id gpt_oss"):
        validate(config, world_size=1)
