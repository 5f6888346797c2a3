"""DeepSeek-V4's MTP layers (models/deepseek_v4/mtp.py) under `model_id deepseek_v4`: a tiny checkpoint with one MTP
layer in DeepSeek's release layout (`mtp.0.*`: the block's `attn.wq_a` / `attn.kv_norm` / `ffn.experts.{e}.w1` /
`hc_attn_fn` keys, enorm / hnorm / e_proj / h_proj / norm / hc_head_*, MindSpeed's optional embedding and head
copies), random non-default tensors, loads where the reference below says; the logged MTP loss equals DeepSeek's
MTPBlock formula computed here by hand around transformers' own DeepSeek-V4 decoder layer holding the MTP tensors;
two steps train with the MTP loss logged; the export writes the MTP tensors back under DeepSeek's names and reloads
exactly."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from tests.support.mtp_layouts import FACTOR, assert_export_round_trip, full_state, mtp_batch, mtp_trainer
from tests.support.tiny_models import tiny_newer_config

N = 2  # main layers; the MTP layer is DeepSeek's layer id N


def _full_config():
    """The tiny deepseek_v4 config with one more layer, DeepSeek's MTP layer kind: sliding window, top-k MoE."""
    config = tiny_newer_config("deepseek_v4")
    values = config.to_dict()
    values.update(num_hidden_layers=N + 1, layer_types=list(config.layer_types) + ["sliding_attention"],
                  mlp_layer_types=list(config.mlp_layer_types) + ["moe"])
    values.pop("transformers_version", None)
    return type(config)(**{k: v for k, v in values.items() if k != "model_type"})


@pytest.fixture()
def v4_dir(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(5)
    full = DeepseekV4ForCausalLM(_full_config()).eval()
    with torch.no_grad():
        for param in full.parameters():
            param.normal_(0.0, 0.3 if param.dim() == 1 else 0.15)
        for name, buf in full.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.1)
            if name.endswith("tid2eid"):
                buf.copy_(torch.randint(0, 4, buf.shape))
    full.save_pretrained(tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(shard)
    p = f"model.layers.{N}."
    # DeepSeek's release names the MTP block's keys mtp.0.<block key>, its kv norm `attn.kv_norm` (transformers'
    # save spells it `attn.norm`; both load)
    mtp = {"mtp.0." + k[len(p):].replace("attn.norm.", "attn.kv_norm."): v for k, v in tensors.items()
           if k.startswith(p)}
    tensors = {k: v for k, v in tensors.items() if not k.startswith(p)}
    gen = torch.Generator().manual_seed(9)
    h, hc = 32, 2
    mtp.update({"mtp.0.enorm.weight": 1 + torch.randn(h, generator=gen) * 0.3,
                "mtp.0.hnorm.weight": 1 + torch.randn(h, generator=gen) * 0.3,
                "mtp.0.e_proj.weight": torch.randn(h, h, generator=gen) * 0.15,
                "mtp.0.h_proj.weight": torch.randn(h, h, generator=gen) * 0.15,
                "mtp.0.norm.weight": 1 + torch.randn(h, generator=gen) * 0.3,
                "mtp.0.hc_head_fn": torch.randn(hc, hc * h, generator=gen) * 0.15,
                "mtp.0.hc_head_base": torch.randn(hc, generator=gen) * 0.3,
                "mtp.0.hc_head_scale": 1 + torch.randn(1, generator=gen) * 0.3,
                "mtp.0.emb.tok_emb.weight": tensors["model.embed_tokens.weight"].clone(),  # MindSpeed's copies
                "mtp.0.head.weight": tensors["head.weight"].clone()})
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config.update(num_hidden_layers=N, layer_types=config["layer_types"][:N],
                  mlp_layer_types=config["mlp_layer_types"][:N], num_nextn_predict_layers=1)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    return tmp_path / "ckpt", mtp, full


# DeepSeek's direct MTP keys -> ours (eh_proj = [e_proj | h_proj] checked separately)
DIRECT = {"mtp.0.enorm.weight": "mtp.layers.0.enorm.weight", "mtp.0.hnorm.weight": "mtp.layers.0.hnorm.weight",
          "mtp.0.norm.weight": "mtp.layers.0.final_layernorm.weight", "mtp.0.hc_head_fn": "mtp.layers.0.hc_head.hc_fn",
          "mtp.0.hc_head_base": "mtp.layers.0.hc_head.hc_base",
          "mtp.0.hc_head_scale": "mtp.layers.0.hc_head.hc_scale"}


def _rms(x, w, eps=1e-6):
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_loss(path, mtp, full, batch):
    """DeepSeek's MTPBlock (inference/model.py) by hand: the main model's streams before its hc_head (transformers'
    N-layer model), e_proj(enorm(embedding of t+1)) broadcast + h_proj(hnorm(each stream)), transformers' decoder
    layer holding the MTP tensors, the depth's hc_head collapse, its norm, the main head."""
    from transformers import DeepseekV4ForCausalLM

    main = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids, labels, mask, pos = batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]
    roll = lambda t: torch.cat([t[:, 1:], torch.zeros_like(t[:, :1])], 1)  # noqa: E731
    ids1, labels1, mask1 = roll(ids), roll(labels), roll(mask)
    seen = {}
    hooks = [main.model.hc_head.register_forward_pre_hook(lambda m, args: seen.__setitem__("streams", args[0])),
             main.model.layers[-1].register_forward_pre_hook(
                 lambda m, args, kwargs: seen.__setitem__("kwargs", kwargs), with_kwargs=True)]
    with torch.no_grad():
        main(input_ids=ids, position_ids=pos, use_cache=False)
        for hook in hooks:
            hook.remove()
        kwargs = {k: v for k, v in seen["kwargs"].items() if k not in ("input_ids", "hidden_states")}
        e = _rms(main.model.embed_tokens.weight[ids1], mtp["mtp.0.enorm.weight"])
        x = (e @ mtp["mtp.0.e_proj.weight"].T).unsqueeze(2) + _rms(seen["streams"], mtp["mtp.0.hnorm.weight"]) @ \
            mtp["mtp.0.h_proj.weight"].T
        x = full.model.layers[N](x, **kwargs)
        flat = x.flatten(2)
        mixes = (flat @ mtp["mtp.0.hc_head_fn"].T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
        pre = torch.sigmoid(mixes * mtp["mtp.0.hc_head_scale"] + mtp["mtp.0.hc_head_base"]) + 1e-6
        y = _rms((pre.unsqueeze(-1) * x).sum(2), mtp["mtp.0.norm.weight"])
        ce = F.cross_entropy((y @ main.lm_head.weight.T).flatten(0, 1), labels1.flatten(), reduction="none")
    return ((ce * mask1.flatten()).sum() / mask1.sum()).item()


def test_deepseek_v4_mtp_layer_loads_trains_and_exports_back(v4_dir, tmp_path, capsys):
    from fsdp2_backend.models.deepseek_v4.modeling import ClampedGroupedExperts
    from fsdp2_backend.checkpoint.hf_export import write_hf_dir
    from fsdp2_backend.training.logging import parse_train_line
    from fsdp2_backend.training.loss import GlobalBatchLoss

    path, mtp, full = v4_dir
    trainer, ctx = mtp_trainer(path, "deepseek_v4")
    try:
        state = full_state(trainer.model)
        layer = trainer.model.mtp.layers[0].transformer_layer
        assert isinstance(layer.mlp.experts, ClampedGroupedExperts) and not layer.mlp.is_hash
        assert layer.self_attn.compressor is None  # DeepSeek's MTP attention: the sliding window
        for key, ours in DIRECT.items():
            assert torch.equal(state[ours], mtp[key]), key
        assert torch.equal(state["mtp.layers.0.eh_proj.weight"],
                           torch.cat([mtp["mtp.0.e_proj.weight"], mtp["mtp.0.h_proj.weight"]], 1))
        reference_layer = full.model.layers[N].state_dict()  # the tensors written under the MTP block's keys
        for name, tensor in reference_layer.items():
            assert torch.equal(state["mtp.layers.0.transformer_layer." + name], tensor), name
        batch = mtp_batch(tiny_newer_config("deepseek_v4").vocab_size)
        reference = _reference_loss(path, mtp, full, batch)
        assert math.isfinite(reference) and reference > 1.0
        accounting = GlobalBatchLoss(num_microbatches=1, dp_size=1, calculate_per_token_loss=False)
        with torch.no_grad():
            trainer._forward_loss(batch, accounting)
        assert trainer._finish_mtp(1)["mtp_1 loss"] == pytest.approx(reference, rel=1e-5)
        write_hf_dir(trainer.model, state, tmp_path / "export")  # before training: the loaded tensors
        trainer.train()
        lines = [parse_train_line(line) for line in capsys.readouterr().out.splitlines()]
        logged = [x["losses"]["mtp_1 loss"] for x in lines if x and "mtp_1 loss" in x["losses"]]
        assert len(logged) == 2 and all(math.isfinite(v) for v in logged)
        assert logged[0] == pytest.approx(reference, rel=1e-5)
        trained = full_state(trainer.model)
        for name in ("mtp.layers.0.eh_proj.weight", "mtp.layers.0.hc_head.hc_fn",
                     "mtp.layers.0.transformer_layer.attn_hc.fn"):
            assert not torch.equal(trained[name], state[name]), name  # the MTP loss reaches them
    finally:
        ctx.close()
    assert json.loads((tmp_path / "export" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    # written back under DeepSeek's names, the block's keys spelled as transformers' save spells the main layers'
    # (kv norm `attn.norm`); the embedding / head copies are not written (DeepSeek's model shares them)
    expected = {k.replace("attn.kv_norm.", "attn.norm."): v for k, v in mtp.items()
                if k not in ("mtp.0.emb.tok_emb.weight", "mtp.0.head.weight")}
    assert_export_round_trip(tmp_path / "export", "mtp.", expected, state, "deepseek_v4")


def test_second_depth_takes_the_first_depths_streams():
    """Two depths (a config declaring two): depth 2 gets depth 1's output streams before its hc_head and norm
    (DeepSeek's MTPBlock takes streams), the embedding of token t+2, and its own tensors; the per-depth losses
    equal the chain computed here by hand (the decoder layers' own modules, everything around them in plain ops)."""
    from fsdp2_backend.models.mtp import attach_mtp, mtp_forward
    from fsdp2_backend.models.mtp import mtp_batch as with_mtp_targets
    from fsdp2_backend.models.registry import model_spec

    config = tiny_newer_config("deepseek_v4")
    config.num_nextn_predict_layers = 2
    torch.manual_seed(2)
    model = attach_mtp(model_spec("deepseek_v4").build(config), 2, seed=4).eval()
    with torch.no_grad():
        for name, param in model.mtp.named_parameters():
            param.normal_(1.0 if param.dim() == 1 and "norm" in name else 0.0, 0.3 if param.dim() == 1 else 0.15)
    batch = mtp_batch(config.vocab_size)
    batch = with_mtp_targets(dict(input_ids=batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                                  position_ids=batch["position_ids"]), 2)
    with torch.no_grad():
        _, sums, counts = mtp_forward(model, batch, 2, lambda s, c: sum(s) * 0)
        seen = {}
        hooks = [model.model.hc_head.register_forward_pre_hook(lambda m, a: seen.__setitem__("streams", a[0])),
                 model.model.layers[-1].register_forward_pre_hook(
                     lambda m, a, kw: seen.__setitem__("kwargs", kw), with_kwargs=True)]
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
        for hook in hooks:
            hook.remove()
        kwargs = {k: v for k, v in seen["kwargs"].items() if k not in ("input_ids", "hidden_states")}
        state, want = seen["streams"], []
        for k, depth in enumerate(model.mtp.layers, start=1):
            w_e, w_h = depth.eh_proj.weight.chunk(2, dim=1)
            e = _rms(model.model.embed_tokens.weight[batch[f"mtp_input_ids_{k}"]], depth.enorm.weight)
            x = (e @ w_e.T).unsqueeze(2) + _rms(state, depth.hnorm.weight) @ w_h.T
            state = depth.transformer_layer(x, **kwargs)
            flat = state.flatten(2)
            mixes = (flat @ depth.hc_head.hc_fn.T) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
            pre = torch.sigmoid(mixes * depth.hc_head.hc_scale + depth.hc_head.hc_base) + 1e-6
            y = _rms((pre.unsqueeze(-1) * state).sum(2), depth.final_layernorm.weight)
            ce = F.cross_entropy((y @ model.lm_head.weight.T).flatten(0, 1), batch[f"mtp_labels_{k}"].flatten(),
                                 reduction="none")
            mask = batch[f"mtp_loss_mask_{k}"].flatten()
            want.append(((ce * mask).sum() / mask.sum()).item())
    got = [float(s / c) for s, c in zip(sums, counts)]
    assert got == pytest.approx(want, rel=1e-5)
    assert abs(want[0] - want[1]) > 1e-3  # two different depths


def test_layouts_the_layout_cannot_hold_are_declined(tmp_path):
    from fsdp2_backend.models.deepseek_v4.mtp import DeepseekV4Layout
    from fsdp2_backend.usage_errors import UsageError

    config = tiny_newer_config("deepseek_v4")  # num_nextn_predict_layers 1
    with pytest.raises(UsageError, match="2 MTP layers but the checkpoint has 1"):
        DeepseekV4Layout().check(config, 2)
    (tmp_path / "config.json").write_text(json.dumps({"compress_ratios": [4, 4, 4]}))  # a compressed MTP layer
    config._name_or_path = str(tmp_path)
    with pytest.raises(UsageError, match=r"compress_ratios\[2\] = 4"):
        DeepseekV4Layout().check(config, 1)
    (tmp_path / "config.json").write_text(json.dumps({"compress_ratios": [4, 4, 0]}))  # V4-Flash's: sliding
    DeepseekV4Layout().check(config, 1)
