"""The qwen3_moe model against transformers' Qwen3-MoE (its per-expert loop) for the same weights."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp2_backend.models.moe.experts import GroupedExperts
from fsdp2_backend.models.qwen3_moe.modeling import (Qwen3MoeGroupedForCausalLM, Qwen3MoeRouter, build_qwen3_moe,
                                            checkpoint_keys, configure_moe, from_hf_checkpoint, param_from_checkpoint,
                                            to_hf_checkpoint)
from tests.support.tiny_models import tiny_moe_config


def _pair(**overrides):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(tiny_moe_config(**overrides)).eval()
    ours = build_qwen3_moe(tiny_moe_config(**overrides)).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16), generator=g)
    return dict(input_ids=ids, labels=ids)


@pytest.mark.parametrize("grouped_gemm", [False, True])
def test_logits_aux_loss_and_gradients_equal_transformers(grouped_gemm):
    hf, ours = _pair()
    configure_moe(ours, moe_grouped_gemm=grouped_gemm, fix_router=False)
    assert isinstance(ours.model.layers[0].mlp.experts, GroupedExperts)
    out_hf, out = hf(**_batch()), ours(**_batch())
    torch.testing.assert_close(out.logits, out_hf.logits, rtol=1e-5, atol=1e-5)
    assert float(out.aux_loss.detach()) > 0
    torch.testing.assert_close(out.aux_loss, out_hf.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.loss, out_hf.loss, rtol=1e-6, atol=1e-6)  # lm loss + 0.02 * aux loss
    out.loss.backward()
    out_hf.loss.backward()
    grads_hf = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_hf[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fix_router_gives_balanced_counts_and_changes_results():
    hf, ours = _pair()
    router = ours.model.layers[0].mlp.gate
    hidden = torch.randn(10, 64)
    _, free_scores, free_index = router(hidden)
    configure_moe(ours, moe_grouped_gemm=False, fix_router=True)
    assert isinstance(router, Qwen3MoeRouter) and router.fixed
    logits, scores, index = router(hidden)
    assert torch.bincount(index.flatten(), minlength=4).tolist() == [5, 5, 5, 5]
    assert all(len(set(row)) == 2 for row in index.tolist())  # distinct experts per token
    torch.testing.assert_close(scores.sum(-1), torch.ones(10))  # norm_topk_prob still applies
    assert not torch.equal(index, free_index)
    assert not torch.allclose(ours(**_batch()).logits, hf(**_batch()).logits)  # documented: changes results


def test_checkpoint_layout_is_transformers_save_pretrained(tmp_path):
    from transformers import Qwen3MoeForCausalLM

    hf, ours = _pair()
    hf.save_pretrained(tmp_path / "hf")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    converted = to_hf_checkpoint(ours.state_dict())
    assert sorted(converted) == sorted(written)
    for key, tensor in written.items():
        torch.testing.assert_close(converted[key], tensor, rtol=0, atol=0, msg=key)
    back = from_hf_checkpoint(written)
    assert sorted(back) == sorted(ours.state_dict())
    for key, tensor in ours.state_dict().items():
        assert torch.equal(back[key], tensor), key
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert len(checkpoint_keys(name, 4)) == 8
    assert torch.equal(param_from_checkpoint(name, written, 4), ours.state_dict()[name])

    # An export written from our state dict loads in transformers and gives the same logits.
    export = tmp_path / "export"
    ours.config.save_pretrained(export)
    save_file(converted, str(export / "model.safetensors"), metadata={"format": "pt"})
    reloaded = Qwen3MoeForCausalLM.from_pretrained(export).eval()
    torch.testing.assert_close(reloaded(**_batch()).logits, ours(**_batch()).logits, rtol=1e-5, atol=1e-5)


def test_save_pretrained_writes_stock_transformers_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, ours = _pair()
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in load_file(str(tmp_path / "model.safetensors"))
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    again = Qwen3MoeGroupedForCausalLM.from_pretrained(tmp_path).eval()
    assert type(stock).__name__ == "Qwen3MoeForCausalLM"
    assert isinstance(again.model.layers[1].mlp.experts, GroupedExperts)
    for model in (stock, again):
        torch.testing.assert_close(model(**_batch()).logits, ours(**_batch()).logits, rtol=1e-5, atol=1e-5)


def test_init_weights_initialises_grouped_experts_like_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    hf, ours = _pair()
    theirs = Qwen3MoeExperts(hf.config)
    mine = copy.deepcopy(ours.model.layers[0].mlp.experts)
    for module in (theirs, mine):
        module.gate_up_proj = torch.nn.Parameter(torch.zeros_like(module.gate_up_proj))
        module.down_proj = torch.nn.Parameter(torch.zeros_like(module.down_proj))
    torch.manual_seed(5)
    hf._init_weights(theirs)
    torch.manual_seed(5)
    ours._init_weights(mine)
    assert float(mine.gate_up_proj.detach().std()) > 0
    assert torch.equal(mine.gate_up_proj, theirs.gate_up_proj) and torch.equal(mine.down_proj, theirs.down_proj)
