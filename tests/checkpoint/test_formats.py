"""The checkpoint formats (fsdp2_backend/checkpoint/formats.py): each tells its directories apart, says what one
holds and reads it into plain state, checked on directories the real writers made (our CheckpointManager,
transformers' save_pretrained; Megatron-LM's formats on megatron-core's saves in tests/megatron_compat/
test_megatron_import.py and test_megatron_fsdp_dtensor.py). The expected weights are the model's own."""
import dataclasses

import pytest
import torch

from fsdp2_backend.checkpoint import formats
from tests.support.tiny_models import tiny_qwen3_config

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model, our iter_0000006 directory, an HF directory) of one seeded tiny model with tied embeddings."""
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.training.checkpoint import CheckpointManager

    root = tmp_path_factory.mktemp("formats")
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(tie_word_embeddings=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = CheckpointManager(root / "save")
    ours = manager.save(6, model, optimizer, train_state={"consumed_train_samples": 48})
    manager.finalize()
    model.save_pretrained(str(root / "hf"))
    return model, ours, root / "hf"


def test_each_format_detects_its_own_directories_only(saved, tmp_path):
    _, ours, hf = saved
    assert formats.detect_format(ours) is formats.OURS
    assert formats.detect_format(hf) is formats.HF
    assert formats.detect_format(ours.parent) is None  # a save directory is no checkpoint itself
    assert formats.detect_format(tmp_path) is None and formats.detect_format(tmp_path / "absent") is None
    for megatron in (formats.MEGATRON_TORCH_DIST, formats.MEGATRON_LEGACY, formats.MEGATRON_TORCH_DCP,
                     formats.MEGATRON_FSDP_DTENSOR):
        assert not megatron.detect(ours) and not megatron.detect(hf)
    assert formats.OURS.reshards_in_place and not formats.MEGATRON_TORCH_DIST.reshards_in_place


def test_describe_says_what_a_directory_holds(saved):
    _, ours, hf = saved
    assert formats.OURS.describe(ours) == ("this backend's fsdp2-dcp-v1 checkpoint of iteration 6 (saved by 1 "
                                           "rank(s), with optimizer state, with RNG states)")
    assert formats.HF.describe(hf) == "a Hugging Face model directory (qwen3, 1 safetensors file(s))"


def test_read_gives_the_models_weights(saved):
    model, ours, hf = saved
    expected = model.state_dict()
    got = formats.OURS.read(ours)
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    from_hf = formats.HF.read(hf)  # save_pretrained drops the tied head
    assert set(from_hf) == set(expected) - {"lm_head.weight"}
    assert all(torch.equal(from_hf[key], expected[key]) for key in from_hf)


def test_model_config_and_model_args_come_from_the_checkpoint(saved):
    from fsdp2_backend.config.schema import ModelArguments

    model, ours, hf = saved
    config = formats.OURS.model_config(ours, [])
    assert (config["model_type"], config["hidden_size"]) == ("qwen3", model.config.hidden_size)
    assert formats.HF.model_config(hf, [])["num_hidden_layers"] == model.config.num_hidden_layers
    given = ModelArguments(architecture={"model_type": "qwen3"}, tokenizer_type="GPT2BPETokenizer")
    args = formats.OURS.model_args(given, ours)
    assert args == dataclasses.replace(given, model_name_or_path=str(ours / "hf_meta"), train_from_scratch=True,
                                       architecture=None)  # a tokenizer type given: no tokenizer path from hf_meta
    with_dir = dataclasses.replace(given, model_name_or_path=str(hf))
    assert formats.OURS.model_args(with_dir, ours) is with_dir  # an HF directory given too: its model
