"""Megatron-FSDP's ``--ckpt-format fsdp_dtensor`` saves of a megatron-core 0.16.1 model convert with megatron-core's
logits (and resume: tests/megatron_compat/test_megatron_resume.py's fsdp_dtensor case).

No megatron-core producer runs here: megatron-core's Megatron-FSDP (``FullyShardedDataParallel``) needs CUDA
(``.cuda()`` in ``validate_uneven_dtensor``, CUDA streams, einops for its device mesh) and the function that lays
the save out, ``preprocess_fsdp_dtensor_state_dict``, is Megatron-LM's training code, not megatron-core. The save
is therefore written here with torch.distributed.checkpoint from megatron-core's own model state, laid out as
Megatron-LM's documented code does (`fsdp_dtensor_save`): the wrapper's ``module.`` prefixes, each gated
``linear_fc1`` split into ``_w`` (gate) / ``_v`` (up), the optimizer state per parameter name
(``module.module.`` + name), the RNG under ``"(pp, tp)"``.
"""
import pytest
import torch

from tests.support.megatron_checkpoints import SEQ, VOCAB, hf_logits, megatron_enums, megatron_gpt, megatron_logits
from tests.support.megatron_checkpoints import megatron  # noqa: F401  (pytest fixture)
from tests.support.megatron_checkpoints import fsdp_dtensor_save


def test_a_megatron_fsdp_checkpoint_converts_with_equal_logits(megatron, tmp_path):
    from fsdp2_backend.cli.convert_checkpoint import main as convert
    from megatron_compat.checkpoint.dcp_format import model_shapes
    from torch.distributed.checkpoint import FileSystemReader

    model, args = megatron_gpt(True, False, seed=5)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    expected = megatron_logits(model, tokens)
    megatron_enums(args)
    fsdp_dtensor_save(tmp_path / "mg" / "iter_0000007", args, model, 7)
    keys = FileSystemReader(str(tmp_path / "mg" / "iter_0000007")).read_metadata().state_dict_metadata
    assert "model.module.decoder.layers.1.mlp.linear_fc1.weight_w" in keys  # the layout this test writes
    assert "model.module.decoder.layers.1.mlp.linear_fc1.weight" not in keys
    shapes = model_shapes(tmp_path / "mg" / "iter_0000007")
    assert shapes["decoder.layers.1.mlp.linear_fc1.weight"].shape == (2 * 96, 64)
    from fsdp2_backend.checkpoint.formats import MEGATRON_FSDP_DTENSOR, detect_format
    assert detect_format(tmp_path / "mg" / "iter_0000007") is MEGATRON_FSDP_DTENSOR  # told apart by its saved args
    convert([str(tmp_path / "mg"), str(tmp_path / "hf")])
    hf_model, got = hf_logits(tmp_path / "hf", tokens)
    assert hf_model.config.model_type == "qwen3" and hf_model.config.num_key_value_heads == 2
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_a_half_missing_is_one_line(megatron, tmp_path):
    from fsdp2_backend.usage_errors import UsageError
    from megatron_compat.checkpoint.fsdp_dtensor import join_halves

    with pytest.raises(UsageError, match=r"decoder.layers.0.mlp.linear_fc1.weight has only its '_w' half"):
        join_halves({"module.decoder.layers.0.mlp.linear_fc1.weight_w": torch.zeros(2, 2)})


def test_expert_halves_join_under_their_global_index():
    """Experts (global indices, handle_experts_in_state_dict) split as the dense fc1: SequentialMLP's
    local_experts.{e}.linear_fc1.weight_w / _v and TEGroupedMLP's linear_fc1.weight{e}_w / _v."""
    from megatron_compat.checkpoint.fsdp_dtensor import join_halves

    g, u, d = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 3)
    pre = "module.decoder.layers.0.mlp.experts."
    got = join_halves({f"{pre}local_experts.5.linear_fc1.weight_w": g, f"{pre}local_experts.5.linear_fc1.weight_v": u,
                       f"{pre}linear_fc1.weight7_w": u, f"{pre}linear_fc1.weight7_v": g,
                       f"{pre}linear_fc2.weight7": d})
    assert sorted(got) == ["decoder.layers.0.mlp.experts.linear_fc1.weight7",
                           "decoder.layers.0.mlp.experts.linear_fc2.weight7",
                           "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"]
    assert torch.equal(got["decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"], torch.cat([g, u]))
    assert torch.equal(got["decoder.layers.0.mlp.experts.linear_fc1.weight7"], torch.cat([u, g]))
