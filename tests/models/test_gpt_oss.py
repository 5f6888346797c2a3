"""gpt_oss: sink attention through SDPA vs the eager formula, and the gpt_oss model id vs transformers' own
GPT-OSS (eager attention, per-expert loop) for the same weights: logits, aux loss and gradients, with sliding
and full attention layers, packed sequences, grouped GEMM on and off; the MXFP4 loader vs transformers'
own dequantising load; the HF export loads in transformers."""
import json

import pytest
import torch

from fsdp2_backend.models.gpt_oss.modeling import GptOssGroupedExperts, GptOssRouter, build_gpt_oss
from fsdp2_backend.models.qwen3_moe.modeling import configure_moe
from fsdp2_backend.kernels.sink_attention import sink_attention, sink_attention_reference

from tests.support.tiny_models import tiny_gpt_oss_config


@pytest.mark.parametrize("window, block, masked", [(None, 1024, False), (5, 4, False), (3, 7, True)])
def test_sink_attention_equals_eager_formula(window, block, masked):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 19, 8, requires_grad=True) for _ in range(3))
    sinks = torch.randn(4, requires_grad=True)
    mask = None
    if masked:  # transformers' boolean mask: two packed documents, causal within each
        pos = torch.cat([torch.arange(9), torch.arange(10)])
        doc = torch.cat([torch.zeros(9), torch.ones(10)])
        mask = ((pos[:, None] >= pos[None, :]) & (doc[:, None] == doc[None, :]))[None, None].expand(2, 1, 19, 19)
    ours = sink_attention(q, k, v, sinks, attention_mask=mask, sliding_window=None if masked else window, block=block)
    ref = sink_attention_reference(q, k, v, sinks, attention_mask=mask, sliding_window=None if masked else window)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _pair():
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    hf = GptOssForCausalLM(tiny_gpt_oss_config())
    with torch.no_grad():  # transformers initialises sinks and biases to 0: make them matter
        for name, p in hf.named_parameters():
            if "sinks" in name or name.endswith("bias"):
                p.normal_(0, 0.5)
    ours = build_gpt_oss(tiny_gpt_oss_config())
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf.train(), ours.train()


@pytest.mark.parametrize("grouped_gemm", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_logits_aux_loss_and_gradients_equal_transformers(grouped_gemm, packed):
    hf, ours = _pair()
    configure_moe(ours, moe_grouped_gemm=grouped_gemm, fix_router=False)
    assert isinstance(ours.model.layers[0].mlp.experts, GptOssGroupedExperts)
    assert isinstance(ours.model.layers[0].mlp.router, GptOssRouter)
    assert ours.config._attn_implementation == "sink_attention"
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids)
    if packed:  # two documents per row: position ids restart at 0
        batch["position_ids"] = torch.cat([torch.arange(6), torch.arange(8)]).expand(2, -1)
    out_hf, out = hf(**batch), ours(**batch)
    torch.testing.assert_close(out.logits, out_hf.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.aux_loss, out_hf.aux_loss, rtol=1e-6, atol=1e-7)
    out.loss.backward()
    out_hf.loss.backward()
    grads_hf = {n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads_hf[name], rtol=1e-4, atol=1e-6, msg=name)


def test_export_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    _, ours = _pair()
    ours.eval().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["GptOssForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 10))
    torch.testing.assert_close(loaded(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_mxfp4_checkpoint_streams_as_transformers_dequantises_it(tmp_path):
    """An MXFP4 checkpoint (expert weights as `_blocks` + `_scales`): the streaming loader's weights equal those
    transformers' `from_pretrained(..., Mxfp4Config(dequantize=True))` builds."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssForCausalLM, Mxfp4Config

    from fsdp2_backend.models.loading import load_safetensors
    from fsdp2_backend.models.registry import model_spec

    _, ours = _pair()
    ours.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    for key in list(tensors):
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, rows_in, cols_out = tensors.pop(key).shape  # in-memory (E, in, out); MXFP4 packs (E, out, in / 32)
            tensors[key + "_blocks"] = torch.randint(0, 256, (e, cols_out, rows_in // 32, 16), generator=g,
                                                     dtype=torch.uint8)
            tensors[key + "_scales"] = torch.randint(120, 134, (e, cols_out, rows_in // 32), generator=g,
                                                     dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))

    reference = GptOssForCausalLM.from_pretrained(tmp_path, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(tmp_path)
    model = build_gpt_oss(tiny_gpt_oss_config())
    load_safetensors(model, str(tmp_path), spec=model_spec("gpt_oss"), hf_config=hf_config)
    expected = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected[name].float(), rtol=0, atol=0, msg=name)


def test_seeded_initialisation_equals_transformers_model():
    """`train_from_scratch` / meta-device init: the seeded initialisation of the gpt_oss model id writes the weights
    it writes into transformers' own GPT-OSS (the grouped experts initialised as GptOssExperts)."""
    from transformers import GptOssForCausalLM

    from fsdp2_backend.models.loading import seeded_initialize

    hf, ours = GptOssForCausalLM(tiny_gpt_oss_config()), build_gpt_oss(tiny_gpt_oss_config())
    seeded_initialize(hf, seed=7)
    seeded_initialize(ours, seed=7)
    expected = hf.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_sink_attention_dropout_is_unbiased_attention_dropout():
    """Attention dropout (Megatron's default 0.1 on a GPT-OSS built from flags): each draw differs, the mean of
    many draws is the eager formula without dropout (dropout on the probabilities, kept ones scaled by 1/(1-p))."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64)
    exact = sink_attention_reference(q, k, v, sinks, sliding_window=3)
    n = 4000  # the draws as a batch: one SDPA call, an independent dropout mask per batch row
    draws = sink_attention(q.expand(n, -1, -1, -1), k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), sinks,
                           sliding_window=3, dropout_p=0.3)
    assert not torch.allclose(draws[0], draws[1])
    torch.testing.assert_close(draws.mean(0), exact[0], rtol=0, atol=0.05)
