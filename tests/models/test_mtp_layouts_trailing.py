"""Released MTP layouts that append the MTP layers to `model.layers` (models/mtp_layouts.py): Step-3.5 and
DeepSeek-V3. A tiny checkpoint in the published key layout (random tensors) loads where the reference mapping
below says; the MTP loss equals a reference computed here from those checkpoint tensors (Step-3.5: all in plain
torch ops, from the hidden states *before* the final norm, as Step-3.5's model feeds them; DeepSeek-V3: plain ops
around transformers' own decoder layer holding the checkpoint's MTP-layer tensors); the export writes them back
under the same keys and reloads exactly. Shared helpers: tests/models/test_mtp_layouts.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.mtp_layouts import (assert_export_round_trip, full_state, mtp_batch, mtp_trainer, partial_rope,
                                       swiglu, zero_centered_rms)


# ------------------------------------------------------------------------------------------------- Step-3.5
def _step35_mtp_tensors(cfg, head, seed=11):
    """Step-3.5's published MTP keys for one MTP layer (index N = num_hidden_layers; vLLM step3p5_mtp.py: a
    full-attention, dense decoder layer's own keys, enorm / hnorm / eh_proj, transformer.shared_head.*), random."""
    gen = torch.Generator().manual_seed(seed)
    h, hd, nkv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size
    nh = cfg.per_layer_config[0].num_attention_heads  # the full-attention layers' heads (layer 0 is one)
    p = f"model.layers.{cfg.num_hidden_layers}."
    shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
              "transformer.shared_head.norm.weight": (h,), "input_layernorm.weight": (h,),
              "post_attention_layernorm.weight": (h,), "self_attn.q_proj.weight": (nh * hd, h),
              "self_attn.k_proj.weight": (nkv * hd, h), "self_attn.v_proj.weight": (nkv * hd, h),
              "self_attn.o_proj.weight": (h, nh * hd), "self_attn.q_norm.weight": (hd,),
              "self_attn.k_norm.weight": (hd,), "self_attn.g_proj.weight": (nh, h),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    out = {p + k: torch.randn(s, generator=gen) * (0.3 if len(s) == 1 else 0.15) for k, s in shapes.items()}
    out[p + "transformer.shared_head.output.weight"] = head.weight.detach().clone()  # the lm head's copy
    return out


def _step35_reference_name(key, n):
    rest = key[len(f"model.layers.{n}."):]
    return {"enorm.weight": "mtp.layers.0.enorm.weight", "hnorm.weight": "mtp.layers.0.hnorm.weight",
            "eh_proj.weight": "mtp.layers.0.eh_proj.weight",
            "transformer.shared_head.norm.weight": "mtp.layers.0.final_layernorm.weight"}.get(
        rest, "mtp.layers.0.transformer_layer." + rest)


@pytest.fixture()
def step35_dir(tmp_path):
    from safetensors.torch import load_file, save_file

    from tests.support.step35_reference import (step35_config, step35_config_dict, step35_reference,
                                                write_step35_checkpoint)

    cfg = step35_config()
    text, head = step35_reference(cfg, large_mlp=False)
    write_step35_checkpoint(tmp_path / "ckpt", text, head, step35_config_dict())
    shard = tmp_path / "ckpt" / "model.safetensors"
    mtp = _step35_mtp_tensors(cfg, head)
    save_file({**load_file(shard), **mtp}, shard, metadata={"format": "pt"})
    return tmp_path / "ckpt", mtp, text, head, cfg


def _step35_layer(x, w, pos, cfg):
    """Step-3.5's full-attention dense decoder layer by hand: zero-centred norms, per-head zero-centred q/k norms,
    partial rope of the full-attention type, a sigmoid gate per head (g_proj), SwiGLU MLP without clamp."""
    B, S, h = x.shape
    nh, nkv, hd, eps = cfg.per_layer_config[0].num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, \
        cfg.rms_norm_eps
    rope = cfg.rope_parameters["full_attention"]
    rotary_dim = int(hd * rope.get("partial_rotary_factor", 1.0))
    a = zero_centered_rms(x, w["input_layernorm.weight"], eps)
    q = zero_centered_rms((a @ w["self_attn.q_proj.weight"].T).view(B, S, nh, hd), w["self_attn.q_norm.weight"], eps)
    k = zero_centered_rms((a @ w["self_attn.k_proj.weight"].T).view(B, S, nkv, hd), w["self_attn.k_norm.weight"], eps)
    v = (a @ w["self_attn.v_proj.weight"].T).view(B, S, nkv, hd)
    q = partial_rope(q, pos, rope["rope_theta"], rotary_dim).transpose(1, 2)
    k = partial_rope(k, pos, rope["rope_theta"], rotary_dim).transpose(1, 2).repeat_interleave(nh // nkv, 1)
    v = v.transpose(1, 2).repeat_interleave(nh // nkv, 1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1),
                                                                    float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2)  # [B, S, nh, hd]
    attn = (attn * torch.sigmoid(a @ w["self_attn.g_proj.weight"].T)[..., None]).reshape(B, S, nh * hd)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    m = zero_centered_rms(x, w["post_attention_layernorm.weight"], eps)
    return x + swiglu(m, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])


def _step35_reference_loss(text, head, mtp, cfg, batch):
    """Depth 1 as Step-3.5's model runs it: the main hidden states *before* the final norm (captured from
    transformers' Step text model), its embedding of token t+1, the checkpoint's MTP tensors, the lm head."""
    ids, labels, mask, pos = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    seen = {}
    handle = text.norm.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0]))
    with torch.no_grad():
        text(input_ids=ids, position_ids=pos)
    handle.remove()
    roll = lambda t: torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1)  # noqa: E731
    ids1, labels1, mask1 = roll(ids), roll(labels), roll(mask)
    p, eps = f"model.layers.{cfg.num_hidden_layers}.", cfg.rms_norm_eps
    emb = text.embed_tokens.weight.detach()[ids1]
    x = torch.cat([zero_centered_rms(emb, mtp[p + "enorm.weight"], eps), zero_centered_rms(seen["hidden"], mtp[p + "hnorm.weight"], eps)],
                  -1) @ mtp[p + "eh_proj.weight"].T
    layer = {k[len(p):]: v for k, v in mtp.items() if k.startswith(p)}
    x = zero_centered_rms(_step35_layer(x, layer, pos, cfg), mtp[p + "transformer.shared_head.norm.weight"], eps)
    ce = F.cross_entropy((x @ head.weight.detach().T).flatten(0, 1), labels1.flatten(), reduction="none")
    return ((ce * mask1.flatten()).sum() / mask1.sum()).item()


def test_step35_mtp_layers_load_train_and_export_back(step35_dir, tmp_path, capsys):
    from fsdp2_backend.checkpoint.hf_export import write_hf_dir
    from fsdp2_backend.training.logging import parse_train_line
    from fsdp2_backend.training.loss import GlobalBatchLoss

    path, mtp, text, head, cfg = step35_dir
    n = cfg.num_hidden_layers
    trainer, ctx = mtp_trainer(path, "step35")
    try:
        state = full_state(trainer.model)
        for key, tensor in mtp.items():  # every published tensor where the reference mapping says
            if key.endswith("shared_head.output.weight"):
                assert torch.equal(state["lm_head.weight"], tensor)  # Megatron's shared head = its copy
                continue
            assert torch.equal(state[_step35_reference_name(key, n)], tensor), key
        batch = mtp_batch(cfg.vocab_size)
        reference = _step35_reference_loss(text, head, mtp, cfg, batch)
        accounting = GlobalBatchLoss(num_microbatches=1, dp_size=1, calculate_per_token_loss=False)
        with torch.no_grad():
            trainer._forward_loss(batch, accounting)
        assert trainer._finish_mtp(1)["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        write_hf_dir(trainer.model, state, tmp_path / "export")  # before training: the loaded tensors
        trainer.train()
        lines = [parse_train_line(line) for line in capsys.readouterr().out.splitlines()]
        first = next(x for x in lines if x and x["iteration"] == 1)
        assert first["losses"]["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        assert not torch.equal(full_state(trainer.model)["mtp.layers.0.eh_proj.weight"], mtp[f"model.layers.{n}."
                                                                                              "eh_proj.weight"])
    finally:
        ctx.close()
    import json

    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert_export_round_trip(tmp_path / "export", f"model.layers.{n}.", mtp, state, "step35")


# ---------------------------------------------------------------------------------------------- DeepSeek-V3
def _deepseek_config(layers):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
                              num_experts_per_tok=2, intermediate_size=48, moe_intermediate_size=16,
                              n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1,
                              routed_scaling_factor=2.0, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                              qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


@pytest.fixture()
def deepseek_dir(tmp_path):
    """A DeepSeek-V3 checkpoint as released: N main layers plus one MTP layer at model.layers.N (its decoder-layer
    keys as transformers writes a layer, per-expert), enorm / hnorm / eh_proj / shared_head.norm, and copies of the
    embedding and head (embed_tokens, shared_head.head). Written from an (N+1)-layer transformers model."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    n = 2
    torch.manual_seed(5)
    full = DeepseekV3ForCausalLM(_deepseek_config(n + 1)).eval()
    with torch.no_grad():
        for name, param in full.named_parameters():
            param.normal_(0.0, 0.3 if param.dim() == 1 else 0.15)
        for layer in full.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    full.save_pretrained(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(9)
    h, p = 32, f"model.layers.{n}."
    extra = {p + "enorm.weight": torch.randn(h, generator=gen) * 0.3, p + "hnorm.weight": torch.randn(h, generator=gen),
             p + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.15,
             p + "shared_head.norm.weight": torch.randn(h, generator=gen) * 0.3,
             p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
             p + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    tensors.update(extra)
    save_file(tensors, shard, metadata={"format": "pt"})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    mtp = {k: v for k, v in tensors.items() if k.startswith(p)}
    return tmp_path / "ckpt", mtp, full, n


def _deepseek_reference_name(key, n):
    rest = key[len(f"model.layers.{n}."):]
    named = {"enorm.weight": "mtp.layers.0.enorm.weight", "hnorm.weight": "mtp.layers.0.hnorm.weight",
             "eh_proj.weight": "mtp.layers.0.eh_proj.weight",
             "shared_head.norm.weight": "mtp.layers.0.final_layernorm.weight",
             "embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
    return named.get(rest, "mtp.layers.0.transformer_layer." + rest)


def _deepseek_reference_loss(path, mtp, full, n, batch):
    """Depth 1 by hand around transformers' own DeepSeek-V3 decoder layer (the (N+1)-layer model's last layer,
    which holds the checkpoint's MTP layer tensors): normed main hidden states of transformers' N-layer model."""
    from transformers import DeepseekV3ForCausalLM

    main = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = main.config
    ids, labels, mask, pos = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    roll = lambda t: torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1)  # noqa: E731
    ids1, labels1, mask1 = roll(ids), roll(labels), roll(mask)
    p, eps = f"model.layers.{n}.", cfg.rms_norm_eps
    rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731  (Llama-style)
    with torch.no_grad():
        hidden = main.model(input_ids=ids, position_ids=pos).last_hidden_state
        x = torch.cat([rms(main.model.embed_tokens.weight[ids1], mtp[p + "enorm.weight"]),
                       rms(hidden, mtp[p + "hnorm.weight"])], -1) @ mtp[p + "eh_proj.weight"].T
        S = ids.size(1)
        causal = torch.zeros(1, 1, S, S).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        x = full.model.layers[n](x, attention_mask=causal, position_ids=pos,
                                 position_embeddings=full.model.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        x = rms(x, mtp[p + "shared_head.norm.weight"])
        ce = F.cross_entropy((x @ main.lm_head.weight.T).flatten(0, 1), labels1.flatten(), reduction="none")
    return ((ce * mask1.flatten()).sum() / mask1.sum()).item()


@pytest.mark.parametrize("model_id", [None, "deepseek_v3"])
def test_deepseek_v3_mtp_layer_loads_and_exports_back(deepseek_dir, tmp_path, model_id):
    from fsdp2_backend.checkpoint.hf_export import write_hf_dir
    from fsdp2_backend.training.loss import GlobalBatchLoss

    path, mtp, full, n = deepseek_dir
    trainer, ctx = mtp_trainer(path, model_id)
    try:
        state = full_state(trainer.model)
        if model_id:  # the MTP layer's MoE block swapped like the main layers'
            from fsdp2_backend.models.moe.experts import GroupedExperts
            from fsdp2_backend.models.moe.family_swap import DeepseekV3Router

            block = trainer.model.mtp.layers[0].transformer_layer.mlp
            assert isinstance(block.experts, GroupedExperts) and isinstance(block.gate, DeepseekV3Router)
        prefix = "mtp.layers.0.transformer_layer.mlp.experts."
        for key, tensor in mtp.items():
            if ".mlp.experts." in key:
                continue
            assert torch.equal(state[_deepseek_reference_name(key, n)], tensor), key
        for e in range(4):
            gate, up, down = (mtp[f"model.layers.{n}.mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                                            "down_proj"))
            assert torch.equal(state[prefix + "gate_up_proj"][e], torch.cat([gate, up])), e
            assert torch.equal(state[prefix + "down_proj"][e], down), e
        batch = mtp_batch(96)
        reference = _deepseek_reference_loss(path, mtp, full, n, batch)
        accounting = GlobalBatchLoss(num_microbatches=1, dp_size=1, calculate_per_token_loss=False)
        with torch.no_grad():
            trainer._forward_loss(batch, accounting)
        assert trainer._finish_mtp(1)["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        write_hf_dir(trainer.model, state, tmp_path / "export")
    finally:
        ctx.close()
    assert_export_round_trip(tmp_path / "export", f"model.layers.{n}.", mtp, state, model_id)
