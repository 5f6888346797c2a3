"""step35 vs transformers' Step-3.5 text model (`Step3p7TextModel`, its per-expert loop and its sigmoid router) +
an lm head, for the same weights: a tiny Step-3.5 config with a dense first layer, full and sliding-window layers
with different head counts and rope theta / partial rotary per type, a non-zero router bias that changes the
selection, clamped SwiGLU on routed and shared experts, a scaling factor and fp32 gate. Logits, loss, the Megatron
aux loss (vs megatron-core's functions on the reference's router logits) and every gradient; a checkpoint written
here in Step-3.5's own on-disk layout (stacked `moe.*_proj`, `moe.router_bias`, `share_expert.*`, an MTP layer)
streams in (also onto the meta device) and the export writes that layout back, loadable by transformers."""
import json

import pytest
import torch
from safetensors.torch import load_file

from fsdp2_backend.config import ModelArguments
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from fsdp2_backend.models.registry import model_spec
from fsdp2_backend.models.step35.modeling import Step35Experts, Step35ForCausalLM, Step35Router

from tests.support.step35_reference import step35_config, step35_config_dict, step35_reference, write_step35_checkpoint


def _megatron_aux(router_logits, top_k, num_experts, coeff):
    """megatron-core's aux loss (sigmoid scores) summed over the MoE layers: the reference for our router's."""
    from megatron.core.transformer.moe.moe_utils import (compute_routing_scores_for_aux_loss,
                                                         switch_load_balancing_loss_func)

    total = 0
    for logits in router_logits:
        routing_map, scores = compute_routing_scores_for_aux_loss(logits, top_k, "sigmoid")
        total = total + switch_load_balancing_loss_func(scores, routing_map.sum(0), logits.shape[0], top_k,
                                                        num_experts, coeff)
    return total


def _ours(config, text, head, grouped_gemm=False, **router_fields):
    ours = model_spec("step35").build(config)
    ours.model.load_state_dict(text.state_dict(), strict=True)
    ours.lm_head.load_state_dict(head.state_dict())
    configure_moe(ours, moe_grouped_gemm=grouped_gemm, fix_router=False,
                  model_args=ModelArguments(**router_fields) if router_fields else None)
    return ours.train()


def test_registry_builds_step35_with_grouped_experts_and_our_router():
    model = model_spec("step35").build(step35_config())
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts")  # the dense first layer
    assert all(isinstance(l.mlp.experts, Step35Experts) and isinstance(l.mlp.gate, Step35Router) for l in layers[1:])
    assert [l.self_attn.q_proj.out_features for l in layers] == [64, 128, 64, 128]  # 4 / 8 heads by type
    assert [l.mlp.experts.limit for l in layers[1:]] == [None, 0.05, None]
    assert layers[1].mlp.gate.settings.scaling_factor == 2.5 and layers[1].mlp.gate.settings.dtype == "fp32"


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_logits_aux_loss_and_gradients_equal_transformers(grouped_gemm):
    config = step35_config()
    text, head = step35_reference(config)
    ours = _ours(config, text, head, grouped_gemm, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ref = text(input_ids=ids, output_router_logits=True)
    logits_ref = head(ref.last_hidden_state)
    aux_ref = _megatron_aux(ref.router_logits, 2, 8, 0.01)
    ce = torch.nn.functional.cross_entropy(logits_ref[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    out = ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.logits, logits_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, aux_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out.loss, ce + aux_ref, rtol=1e-5, atol=1e-6)
    (ce + aux_ref).backward()
    out.loss.backward()
    grads = dict(ours.named_parameters())
    for name, p in text.named_parameters():
        torch.testing.assert_close(grads["model." + name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(grads["lm_head.weight"].grad, head.weight.grad, rtol=1e-4, atol=1e-6)


def test_each_step_feature_changes_the_output():
    """The test weights exercise the router bias, both clamps, the scaling factor and the sliding window."""
    config = step35_config()
    text, head = step35_reference(config)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    base = _ours(config, text, head)(input_ids=ids).logits
    for change in ("bias", "limit", "shared_limit", "scale", "window"):
        ours = _ours(config, text, head)
        block = ours.model.layers[2].mlp
        with torch.no_grad():
            if change == "bias":
                block.gate.e_score_correction_bias.zero_()
            elif change == "limit":
                block.experts.limit = None
            elif change == "shared_limit":
                block.shared_experts.limit = float("inf")
            elif change == "scale":
                block.gate.apply_settings(block.gate.settings.__class__(**{**block.gate.settings.__dict__,
                                                                           "scaling_factor": 1.0}))
            else:
                ours.model.layers[1].self_attn.sliding_window = None
                ours.config.sliding_window = 64
        assert not torch.allclose(ours(input_ids=ids).logits, base, atol=1e-4), change


@pytest.mark.parametrize("meta", [False, True])
def test_checkpoint_layout_streams_in_and_export_round_trips(tmp_path, meta, capsys):
    from fsdp2_backend.models.loading import create_model, load_hf_config

    config = step35_config()
    text, head = step35_reference(config)
    written = write_step35_checkpoint(tmp_path / "ckpt", text, head, step35_config_dict())
    args = ModelArguments(model_name_or_path=str(tmp_path / "ckpt"), model_id="step35",
                          init_model_with_meta_device=meta)
    hf_config = load_hf_config(args)
    assert hf_config.model_type == "step3p5" and hf_config.num_nextn_predict_layers == 1
    model = create_model(args, hf_config, seed=0, device=torch.device("cpu"), parallelize=lambda m: m)
    hf_config._attn_implementation = "eager"
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want = head(text(input_ids=ids).last_hidden_state)
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)

    class _Run:  # the run config fields configure_step35 reads
        optimization = type("O", (), {"moe_grouped_gemm": False, "fix_router": False})()
        model = args
    model_spec("step35").configure(model, _Run(), "cpu")
    assert "the checkpoint's 1 MTP layers (model.layers.4-4) are not loaded" in capsys.readouterr().out

    model.save_pretrained(tmp_path / "export")
    exported = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert set(exported) == {k for k in written if not k.startswith("model.layers.4.")}
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, written[key], rtol=0, atol=0, msg=key)
    saved = json.loads((tmp_path / "export" / "config.json").read_text())
    assert saved["model_type"] == "step3p5" and saved["architectures"] == ["Step3p5ForCausalLM"]
    assert saved["moe_layers_enum"] == "1,2,3" and saved["rope_theta"] == [10000.0, 500.0, 10000.0, 500.0]
    assert saved["attention_other_setting"]["num_attention_heads"] == 8 and saved["num_attention_groups"] == 2
    # back through the project's loader and through transformers' from_pretrained (the registered key mapping)
    again = create_model(ModelArguments(model_name_or_path=str(tmp_path / "export"), model_id="step35"),
                         load_hf_config(ModelArguments(model_name_or_path=str(tmp_path / "export"),
                                                       model_id="step35")),
                         seed=0, device=torch.device("cpu"), parallelize=lambda m: m)
    again.config._attn_implementation = "eager"
    torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    loaded = Step35ForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    loaded.config._attn_implementation = "eager"
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_seeded_init_is_transformers_init():
    """Meta-device build + seeded init = transformers' own initialisation of its Step text model."""
    from fsdp2_backend.models.loading import seeded_initialize

    config = step35_config()
    with torch.device("meta"):
        ours = model_spec("step35").build(config)
    ours.to_empty(device="cpu")
    seeded_initialize(ours, seed=3)
    state = ours.state_dict()
    assert all(torch.count_nonzero(state[k]) == 0 for k in state if k.endswith("norm.weight"))  # zero-centred
    assert all(torch.count_nonzero(state[k]) == 0 for k in state if k.endswith("e_score_correction_bias"))
    experts = state["model.layers.1.mlp.experts.gate_up_proj"]
    assert abs(experts.std().item() - config.initializer_range) < 0.002
    assert all(isinstance(m, GroupedExperts) for m in ours.modules() if "Experts" in type(m).__name__)
