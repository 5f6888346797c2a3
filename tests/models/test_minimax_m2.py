"""minimax_m27 vs transformers' own MiniMaxM2ForCausalLM (per-expert loop, its sigmoid router) for the same
weights, with a non-zero e_score_correction_bias that changes the selection: logits, aux loss, gradients;
the HF export (transformers' per-expert on-disk keys) loads in transformers and streams back through the
project's loader, for the model id and for transformers' own class; fused RoPE leaves the partial rotary alone;
TP declined."""
import pytest
import torch

from fsdp2_backend.models.minimax_m27.modeling import MiniMaxM2GroupedForCausalLM, MiniMaxM2Router
from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.registry import model_spec

from tests.support.tiny_models import tiny_minimax_config
from tests.support.tiny_models import minimax_pair


def test_registry_builds_the_grouped_model():
    model = model_spec("minimax_m27").build(tiny_minimax_config())
    assert isinstance(model, MiniMaxM2GroupedForCausalLM)
    assert all(isinstance(layer.mlp.experts, GroupedExperts) and isinstance(layer.mlp.gate, MiniMaxM2Router)
               for layer in model.model.layers)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4 * 16,)  # q norm over the whole projection


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_equals_transformers(grouped_gemm):
    hf, ours = minimax_pair()
    for m in ours.modules():
        if isinstance(m, GroupedExperts):
            m.use_grouped_gemm = grouped_gemm
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want, got = hf(input_ids=ids, labels=ids), ours(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    want.loss.backward()
    got.loss.backward()
    grads = dict(ours.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_bias_changes_selection_and_is_not_updated():
    hf, ours = minimax_pair()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    block = ours.model.layers[0].mlp
    hidden = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    _, _, with_bias = block.gate(hidden, block.e_score_correction_bias)
    _, _, without = block.gate(hidden, torch.zeros_like(block.e_score_correction_bias))
    assert not torch.equal(with_bias.sort(-1)[0], without.sort(-1)[0])  # the test's bias matters
    before = block.e_score_correction_bias.clone()
    from fsdp2_backend.models.moe.router import finish_router_step

    ours(input_ids=ids).logits.sum().backward()
    finish_router_step(ours, 1)
    torch.testing.assert_close(block.e_score_correction_bias, before, rtol=0, atol=0)


def test_hf_export_loads_in_transformers_and_streams_back(tmp_path):
    from safetensors import safe_open
    from transformers import MiniMaxM2ForCausalLM

    from fsdp2_backend.models.loading import load_safetensors

    _, ours = minimax_pair()
    ours.save_pretrained(tmp_path)
    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        keys = set(f.keys())
    # transformers writes MiniMax-M2's own on-disk layout
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in keys
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    ours.eval()
    want = ours(input_ids=ids).logits
    loaded = MiniMaxM2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    config = tiny_minimax_config()
    for model, spec in ((model_spec("minimax_m27").build(config), model_spec("minimax_m27")),
                        (MiniMaxM2ForCausalLM(config), None)):  # model_id unset: transformers' own class
        load_safetensors(model, str(tmp_path), spec=spec, hf_config=config)
        state, ref = model.state_dict(), ours.state_dict()
        for name, tensor in ref.items():
            torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def test_fused_rotary_leaves_partial_rope_alone():
    from fsdp2_backend.parallel.kernel_swaps import _use_fused_rotary

    _, ours = minimax_pair()
    line = _use_fused_rotary(ours, "cpu")
    assert "MiniMaxM2Attention" in line and "left alone" in line
    assert all("forward" not in vars(m) for m in ours.modules())


def test_tp_declined():
    from fsdp2_backend.config.rules.parallel import check_model_layout
    from fsdp2_backend.config.model_facts import ModelFacts
    from tests.support.configs import messages, pt_config

    config = pt_config(model={"model_id": "minimax_m27"}, parallel={"tp_size": 2})
    errors = []
    check_model_layout(config, ModelFacts(source="", num_heads=4, num_kv_heads=2), 2, errors)
    assert errors and errors[0].startswith("parallel.tp_size: model_id minimax_m27")
    assert any(m.startswith("parallel.tp_size: model_id minimax_m27") for m in messages(config, world_size=2))


def test_expert_bias_update_moves_the_checkpoint_bias():
    """Megatron's aux-loss-free update (MindSpeed's MiniMax-M2.7 script sets it): after a step the block's own
    e_score_correction_bias moves by rate * sign(mean load - load), the load counted here from each block's input
    with plain sigmoid top-k on scores + bias (megatron-core's formula)."""
    from types import SimpleNamespace

    from fsdp2_backend.models.minimax_m27.modeling import configure_minimax
    from fsdp2_backend.models.moe.router import finish_router_step
    from fsdp2_backend.config.validation import validate
    from tests.support.configs import pt_config

    validate(pt_config(model={"model_id": "minimax_m27", "moe_router_enable_expert_bias": True}))  # no decline
    _, ours = minimax_pair()
    model_args = pt_config(model={"model_id": "minimax_m27", "moe_router_enable_expert_bias": True,
                                  "moe_router_bias_update_rate": 0.01}).model
    configure_minimax(ours, SimpleNamespace(model=model_args, optimization=SimpleNamespace(
        moe_grouped_gemm=False, fix_router=False)))
    inputs = {}
    for i, layer in enumerate(ours.model.layers):
        layer.mlp.register_forward_hook(lambda m, args, out, i=i: inputs.__setitem__(i, args[0].detach()))
    before = [layer.mlp.e_score_correction_bias.clone() for layer in ours.model.layers]
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    ours(input_ids=ids).logits.sum().backward()
    finish_router_step(ours, 1)
    for i, layer in enumerate(ours.model.layers):
        block = layer.mlp
        scores = torch.sigmoid(inputs[i].reshape(-1, 64) @ block.gate.weight.detach().T)
        chosen = torch.topk(scores + before[i], 2, dim=-1).indices
        load = torch.bincount(chosen.reshape(-1), minlength=8).float()
        want = before[i] + 0.01 * torch.sign(load.mean() - load)
        assert not torch.equal(want, before[i])
        torch.testing.assert_close(block.e_score_correction_bias, want, rtol=0, atol=1e-7)
        assert "gate.expert_bias" not in dict(ours.named_buffers())  # one bias, under transformers' name
