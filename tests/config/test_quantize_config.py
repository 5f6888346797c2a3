"""Quantised-training config: the validation rules of `model.quant_*` and Megatron's FP8 flags' translation."""
import pytest

from fsdp2_backend.config import Config
from fsdp2_backend.config.validation import validate, validate_with_notices
from megatron_compat.translate import translate_megatron
from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS
from fsdp2_backend.usage_errors import UsageError


def _config(**model):
    config = Config()
    config.training.stage, config.data.data_manager_type = "pt", "mg"
    config.model.architecture = dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=128)
    config.data.mock_data = True
    config.training.save_checkpoints = False
    for key, value in model.items():
        setattr(config.model, key, value)
    return config


def _errors(config, world=1):
    with pytest.raises(UsageError) as err:
        validate(config, world)
    return err.value.messages


def test_mxfp8_with_defaults_validates():
    validate(_config(quant_recipe_name="mxfp8"))


def test_unknown_converter_is_an_error_listing_the_known_ones():
    messages = _errors(_config(quant_recipe_name="mxfp8", quant_converters=["quantize.linear.mx", "quantize.fp8"]))
    line = next(m for m in messages if m.startswith("model.quant_converters"))
    assert "'quantize.fp8'" in line and "quantize.linear.mx" in line and "quantize.moe.mx" in line


def test_quant_fields_without_a_recipe_are_errors():
    messages = _errors(_config(quant_ignored_modules=["*lm_head"], fsdp_low_precision_all_gather_mode="all"))
    assert any(m.startswith("model.quant_ignored_modules: only used with model.quant_recipe_name") for m in messages)
    assert any(m.startswith("model.fsdp_low_precision_all_gather_mode: only used") for m in messages)


def test_tensor_parallel_is_declined_with_the_reason():
    config = _config(quant_recipe_name="mxfp8")
    config.parallel.tp_size = 2
    assert any("tensor parallel" in m and m.startswith("model.quant_recipe_name") for m in _errors(config, world=2))


def test_mode_without_low_precision_gather_is_a_notice():
    _, notices = validate_with_notices(_config(quant_recipe_name="mxfp8", enable_fsdp_low_precision_all_gather=False,
                                               fsdp_low_precision_all_gather_mode="all"))
    assert any(n.startswith("model.fsdp_low_precision_all_gather_mode: no effect") for n in notices)


def test_megatron_mxfp8_flags_map_to_the_quant_fields():
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather".split()).fields
    assert fields["model"]["quant_recipe_name"] == "mxfp8"
    assert fields["model"]["enable_fsdp_low_precision_all_gather"] is True
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--fp8-format e4m3 --fp8-recipe mxfp8".split()).fields
    assert fields["model"]["enable_fsdp_low_precision_all_gather"] is False  # Megatron gathers bf16 without it
    assert "quant_recipe_name" not in translate_megatron(TRANSLATE_BASE_FLAGS).fields["model"]


@pytest.mark.parametrize("flags, why", [("--fp8-format e4m3 --fp8-recipe custom", "--fp8-recipe custom"),
                                        ("--fp8-format hybrid --fp8-recipe mxfp8", "E5M2 gradients")])
def test_other_fp8_recipes_are_declined_with_a_reason(flags, why):
    with pytest.raises(UsageError) as err:
        translate_megatron(TRANSLATE_BASE_FLAGS + flags.split())
    line = next(m for m in err.value.messages if m.startswith("--fp8-format:"))
    assert why in line and " — " in line


def test_fp8_under_tensor_and_context_parallel_validates_blockwise_needs_whole_token_blocks():
    for recipe in ("tensorwise", "rowwise"):
        config = _config(quant_recipe_name=recipe, quant_converters=["quantize.linear.float8"])
        config.parallel.tp_size, config.parallel.cp_size, config.data.cutoff_len = 2, 2, 96
        validate(config, 4)
    config = _config(quant_recipe_name="blockwise", quant_converters=["quantize.linear.float8"])
    config.parallel.cp_size, config.data.cutoff_len = 2, 768  # 2 chunks of 192 tokens a rank: blocks straddle
    (message,) = [m for m in _errors(config, world=2) if m.startswith("model.quant_recipe_name")]
    assert "data.cutoff_len 768 is not a multiple of 2 × cp_size × 128 = 512" in message
    config.data.cutoff_len = 1024
    validate(config, 2)
