"""FP8 block-quantised checkpoints (e4m3 weights + `weight_scale_inv` blocks) dequantised by the streaming
loader vs transformers' own dequantisation: its `Fp8Dequantize` / `_dequantize_fp8_weight` functions on the
same tensors, and its `from_pretrained` (which dequantises FP8 checkpoints on CPU) of a MiniMax-M2 checkpoint
with per-expert keys — for the minimax_m27 model id and for transformers' own class (model_id unset)."""
import json
import re

import torch
from safetensors.torch import load_file, save_file

from fsdp2_backend.models.fp8_blocks import block_size, dequantize
from fsdp2_backend.models.loading import load_safetensors
from fsdp2_backend.models.registry import model_spec
from tests.support.tiny_models import tiny_minimax_config
from tests.support.tiny_models import minimax_pair

_QUANTISED = re.compile(r".*(\.(q|k|v|o)_proj|\.experts\.\d+\.w[123])\.weight$")


def quantise(weight: torch.Tensor, block):
    """Test data: per-block amax / 448 scales (the e4m3 range), as FP8 checkpoints are made."""
    rows, cols = weight.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = weight
    amax = padded.view(nr, br, nc, bc).abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / 448.0
    q = (padded.view(nr, br, nc, bc) / scale_inv[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale_inv


def test_dequantize_equals_transformers_functions():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    gen = torch.Generator().manual_seed(0)
    for shape in ((256, 384), (200, 300)):  # whole blocks, and partial last blocks (cropped scales)
        w, s = quantise(torch.randn(*shape, generator=gen), (128, 128))
        ours = dequantize(w, s, (128, 128))
        torch.testing.assert_close(ours, _dequantize_fp8_weight(w, s, [128, 128], torch.float32), rtol=0, atol=0)
        if shape[0] % 128 == 0 and shape[1] % 128 == 0:
            ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.float32)
            torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    # stacked (E, rows, cols) experts with (E, ...) scales
    w, s = zip(*(quantise(torch.randn(128, 256, generator=gen), (128, 128)) for _ in range(3)))
    torch.testing.assert_close(dequantize(torch.stack(w), torch.stack(s)),
                               torch.stack([dequantize(a, b) for a, b in zip(w, s)]), rtol=0, atol=0)


def _fp8_checkpoint(path, block=(16, 16)):
    _, ours = minimax_pair()
    ours.save_pretrained(path)  # transformers' per-expert MiniMax-M2 layout
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    out = {}
    for key, tensor in tensors.items():
        if _QUANTISED.match(key):
            out[key], out[key + "_scale_inv"] = quantise(tensor.float(), block)
        else:
            out[key] = tensor
    assert any(t.dtype == torch.float8_e4m3fn for t in out.values())
    save_file(out, str(file), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))
    return ours


def test_fp8_minimax_checkpoint_streams_as_transformers_loads_it(tmp_path):
    from transformers import AutoConfig, MiniMaxM2ForCausalLM

    original = _fp8_checkpoint(tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    assert block_size(hf_config) == (16, 16)
    reference = MiniMaxM2ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # dequantises on CPU
    want = reference.state_dict()
    # the checkpoint is really quantised: dequantised weights differ from the originals, a little
    q = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(want[q], original.state_dict()[q])
    torch.testing.assert_close(want[q], original.state_dict()[q], rtol=0.1, atol=0.02)
    config = tiny_minimax_config()
    for model, spec in ((model_spec("minimax_m27").build(config), model_spec("minimax_m27")),
                        (MiniMaxM2ForCausalLM(config), None)):
        load_safetensors(model, str(tmp_path), spec=spec, hf_config=hf_config)
        got = model.state_dict()
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
