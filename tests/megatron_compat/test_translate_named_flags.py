"""Validation errors on a field that a Megatron flag set name the flags the user typed, as well as the field
(megatron_compat/translate/named_flags.py; issue 38 part 5)."""
import pytest

from fsdp2_backend.launch import parse_for_world
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.translate import translate_report
from megatron_compat.translate.named_flags import name_flags
from tests.support.megatron_lines import SMALL_LLAMA_LINE

LINE = SMALL_LLAMA_LINE


def test_a_declined_fp8_layout_names_the_fp8_and_tp_flags():
    argv = LINE + "--fp8-recipe mxfp8 --tensor-model-parallel-size 2 --fp8-format e4m3".split()
    with pytest.raises(UsageError) as exc:
        parse_for_world(argv, None)
    (message,) = [m for m in exc.value.messages if m.startswith("model.quant_recipe_name")]
    # the flags in command-line order, after the field; the advice's field names its flag too
    assert message.startswith("model.quant_recipe_name (from --fp8-recipe, --fp8-format): ")
    assert "parallel.tp_size (from --tensor-model-parallel-size) 1" in message


def test_each_field_records_every_flag_that_determined_it():
    t = translate_report(LINE + "--fp8-format hybrid --fp8-recipe blockwise --fp8-param-gather "
                                "--num-query-groups 2 --group-query-attention".split())
    flags = t.field_flags
    assert flags["model.quant_recipe_name"] == ["--fp8-format", "--fp8-recipe"]
    assert flags["model.enable_fsdp_low_precision_all_gather"] == ["--fp8-format", "--fp8-recipe",
                                                                   "--fp8-param-gather"]
    assert flags["training.global_batch_size"] == ["--global-batch-size"]
    assert flags["model.architecture.num_key_value_heads"] == ["--num-query-groups", "--group-query-attention"]
    assert "training.seed" not in flags  # Megatron's default, no flag typed


def test_messages_are_unchanged_where_no_flag_set_the_field_or_the_flag_is_named():
    flags = {"parallel.tp_size": ["--tensor-model-parallel-size"], "model.architecture": ["--num-layers"]}
    messages = ["training.seed: must be >= 0 — fix it",
                "parallel.tp_size (--tensor-model-parallel-size): 3 does not divide 4 — pick a divisor",
                "model.architecture.hidden_size: 60 — use a multiple of 64; parallel.tp_size too"]
    assert name_flags(messages, flags) == [
        messages[0], messages[1],
        "model.architecture.hidden_size (from --num-layers): 60 — use a multiple of 64; parallel.tp_size (from "
        "--tensor-model-parallel-size) too"]
