"""MindSpeed's MLA latent scales (models/mla_lora_scale.py): training forward and backward equal an independent
reference (the same factors put into the latent RMSNorm weights: norm(x)·w·s), the live HF export and the offline
conversion of a saved checkpoint fold them into q_b_proj / kv_b_proj so transformers' model gives the same logits."""
import copy
import json

import pytest
import torch

from fsdp2_backend.usage_errors import UsageError

from tests.support.tiny_models import Q_RANK, tiny_mla_config

S_Q, S_KV = 2.0, 8 ** 0.5  # sqrt(64 / 16), sqrt(64 / 8): MindSpeed's (hidden / rank) ** 0.5, written by hand


def _model(q_lora_rank=Q_RANK):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(tiny_mla_config(q_lora_rank)).eval()
    with torch.no_grad():  # non-trivial norm weights, so a factor put in the wrong place would show
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _reference(model, q=True, kv=True):
    """The factors applied where MindSpeed applies them (after the latent norm), by scaling the norm's weight."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.model.layers:
            if q:
                layer.self_attn.q_a_layernorm.weight.mul_(S_Q)
            if kv:
                layer.self_attn.kv_a_layernorm.weight.mul_(S_KV)
    return ref


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("q, kv", [(True, True), (True, False), (False, True)])
def test_training_forward_and_backward_equal_the_reference(q, kv):
    from fsdp2_backend.models.mla_lora_scale import apply_mla_lora_scales

    model = _model()
    plain = model(input_ids=IDS).logits
    ref = _reference(model, q, kv)
    targets = apply_mla_lora_scales(model, q, kv)
    assert targets == {**({f"model.layers.{i}.self_attn.q_b_proj": S_Q for i in range(2)} if q else {}),
                       **({f"model.layers.{i}.self_attn.kv_b_proj": S_KV for i in range(2)} if kv else {})}
    out, expected = model(input_ids=IDS, labels=IDS), ref(input_ids=IDS, labels=IDS)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.logits, plain, atol=1e-3)  # the factor changes the model
    out.loss.backward()
    expected.loss.backward()
    for name in ("q_b_proj", "kv_b_proj", "q_a_proj", "kv_a_proj_with_mqa"):
        torch.testing.assert_close(getattr(model.model.layers[1].self_attn, name).weight.grad,
                                   getattr(ref.model.layers[1].self_attn, name).weight.grad, rtol=1e-4, atol=1e-6)


def test_hf_export_folds_the_factors(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.models.mla_lora_scale import apply_mla_lora_scales
    from fsdp2_backend.checkpoint.hf_export import export_hf

    model = _model()
    ref = _reference(model)
    apply_mla_lora_scales(model, True, True)
    export_hf(model, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    torch.testing.assert_close(loaded(input_ids=IDS).logits, ref(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    # the live weights stay the trained ones (the optimizer's parameters); only the export is folded
    torch.testing.assert_close(loaded.model.layers[0].self_attn.q_b_proj.weight,
                               model.model.layers[0].self_attn.q_b_proj.weight * S_Q)
    assert "mla_scale_q_lora" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_offline_conversion_folds_what_the_run_trained_with(tmp_path):
    """convert_checkpoint reads the run's model.mla_scale_* from the checkpoint's run_config.json."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.checkpoint import dirs
    from fsdp2_backend.checkpoint.hf_export import convert_checkpoint

    model = _model()
    ckpt = tmp_path / "save" / "iter_0000004"
    ckpt.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    model.config.save_pretrained(str(ckpt / dirs.HF_META_DIR))
    (ckpt / dirs.META_FILE).write_text(json.dumps({"format": dirs.FORMAT, "iteration": 4}))
    (ckpt / dirs.RUN_CONFIG_FILE).write_text(json.dumps({"model": {"mla_scale_q_lora": False,
                                                                   "mla_scale_kv_lora": True}}))
    convert_checkpoint(ckpt, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    torch.testing.assert_close(loaded(input_ids=IDS).logits, _reference(model, q=False)(input_ids=IDS).logits,
                               rtol=1e-5, atol=1e-5)


def test_no_query_latent_or_no_mla_is_refused():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from fsdp2_backend.models.mla_lora_scale import apply_mla_lora_scales

    with pytest.raises(UsageError, match="no query latent"):
        apply_mla_lora_scales(_model(q_lora_rank=None), True, False)
    assert set(apply_mla_lora_scales(_model(q_lora_rank=None), False, True)) == {
        "model.layers.0.self_attn.kv_b_proj", "model.layers.1.self_attn.kv_b_proj"}
    qwen = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=2,
                                                        num_key_value_heads=1, head_dim=16))
    with pytest.raises(UsageError, match="no multi-latent attention"):
        apply_mla_lora_scales(qwen, False, True)
