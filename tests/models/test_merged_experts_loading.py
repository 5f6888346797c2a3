"""MindSpeed-LLM v26.1.0's LongCat-Flash-Lite YAML loads weights whose experts were merged offline
(`tests/tools/fsdp2/moe_hf_param_merge_experts.sh`, models/merged_experts.py): such a directory, under the release's
model id `longcat_flash`, gives the logits of the original per-expert directory; a stacked tensor of another shape
is declined naming the script.

The merged directory is written by `merge_like_mindspeed` below, which follows our reading of MindSpeed's
`tests/tools/fsdp2/moe_hf_param_merge_experts.py` at tag v26.1.0 (`fuse_layer`: gate and up stacked over experts,
concatenated on the rows, transposed — "3d" `[E, H, 2I]`, or reshaped "2d" `[E·H, 2I]`; down transposed; the other
keys and files copied), from the per-expert keys of an HF LongCat checkpoint (`per_expert`: transformers' save of
this tiny model writes its experts stacked). MindSpeed's script itself (torch and safetensors) has no LongCat spec:
its MODEL_SPECS name qwen3_moe and minimax_m27 only, and the release's LongCat launcher runs a conversion script
(longcat_flash_lite_moe_hf_weight_convert.sh) the release does not ship; "3d" is the layout of MindSpeed's own
LongcatFlashExperts parameters ([E, H, 2I], [E, I, H]). So no real tool writes this fixture here.
"""

import pytest
import torch

from tests.support.tiny_models import NEWER_VOCAB, engine_model, save_tiny
from tests.support.mindspeed_yaml import merge_like_mindspeed


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    path = tmp_path_factory.mktemp("longcat_original")
    save_tiny("longcat_flash_ngram", path, seed=4)
    return path


@pytest.mark.parametrize("fuse_dim", ["3d", "2d"])
def test_merged_expert_directory_gives_the_original_logits(original, tmp_path, fuse_dim):
    merged = tmp_path / "LongCat-Flash-Lite-mergeExperts"
    merge_like_mindspeed(original, merged, fuse_dim)
    ids = torch.randint(6, NEWER_VOCAB, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = engine_model("longcat_flash_ngram", original).eval()(input_ids=ids, labels=ids)
        got = engine_model("longcat_flash", merged).eval()(input_ids=ids, labels=ids)  # the release's id
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)


def test_stacked_tensor_of_another_shape_is_declined_naming_the_script(original, tmp_path):
    from safetensors.torch import load_file, save_file

    from fsdp2_backend.usage_errors import UsageError

    merged = tmp_path / "merged"
    merge_like_mindspeed(original, merged, "3d")
    shard = merged / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    key = next(k for k in tensors if k.endswith("experts.down_proj"))
    tensors[key] = tensors[key][:, :-1].contiguous()  # one row short: neither layout
    save_file(tensors, str(shard))
    with pytest.raises(UsageError) as err:
        engine_model("longcat_flash", merged)
    text = str(err.value)
    assert text.startswith(f"model.model_name_or_path: {key} has shape") and \
        "moe_hf_param_merge_experts.sh" in text, text
