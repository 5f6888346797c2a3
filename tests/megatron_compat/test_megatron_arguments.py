"""The Megatron parser against the Megatron-LM argument table and the MindSpeed names it must know."""
import argparse
import ast
import json
import re

import pytest

from fsdp2_backend.usage_errors import UsageError
from megatron_compat.parse import arguments
from megatron_compat.parse.arguments import build_parser, parse_megatron, parse_megatron_args

TABLE = json.loads(arguments.MEGATRON_TABLE.read_text())
PARSER = build_parser()
ACTIONS = PARSER._option_string_actions
DEFAULTS = parse_megatron_args([])


def _expected_default(record):
    value = record["default"]
    if isinstance(value, str) and value.startswith("["):
        return ast.literal_eval(value)
    match = re.fullmatch(r"<\w+\.(\w+): .*>", value) if isinstance(value, str) else None
    return match.group(1) if match else value


def test_table_has_839_arguments():
    assert len(TABLE) == 839


@pytest.mark.parametrize("record", [r for r in TABLE if r["action"] != "_HelpAction"],
                         ids=lambda r: r["flags"][0])
def test_every_megatron_argument_is_known_with_its_spec(record):
    for flag in record["flags"]:
        assert flag in ACTIONS, flag
    action = ACTIONS[record["flags"][0]]
    assert action.dest == record["dest"]
    kind = {"_StoreTrueAction": argparse._StoreTrueAction, "_StoreFalseAction": argparse._StoreFalseAction,
            "BooleanOptionalAction": argparse.BooleanOptionalAction, "_StoreAction": argparse._StoreAction}
    assert isinstance(action, kind[record["action"]])
    if record["action"] == "_StoreAction":
        # a spaced string value takes its unquoted words too (arguments._SEVERAL_WORDS), joined by the translation
        assert action.nargs == ("+" if record["dest"] in arguments._SEVERAL_WORDS else record["nargs"])
        assert action.type is {"int": int, "float": float, "str": str}.get(record["type"], action.type)
        if record["choices"] and record["type"] != "enum_type_handler":
            assert set(record["choices"]) <= set(action.choices)
    # A shared dest keeps the first action's default (argparse semantics), as Megatron's namespace does.
    first = next(r for r in TABLE if r["dest"] == record["dest"])
    assert getattr(DEFAULTS, record["dest"]) == _expected_default(first)


def test_every_mindspeed_llm_name_is_known():
    names = arguments.mindspeed_llm_names()
    assert len(names) > 250
    assert [n for n in names if n not in ACTIONS] == []


def test_mindspeed_dialect_values():
    ns = parse_megatron_args([
        "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path", "/tok", "--use-fused-rmsnorm",
        "--use-fused-rotary-pos-emb", "--use-flash-attn", "--context-parallel-algo", "ulysses_cp_algo",
        "--spec", "mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec", "--use-mcore-models",
        "--reuse-fp32-param", "--first-k-dense-replace", "-1", "--compress-ratios", "0", "0", "4",
        "--moe-layer-freq", "([0]*3+[1]*11)", "--window-size", "127,0"])
    assert ns.tokenizer_type == "PretrainedFromHF" and ns.tokenizer_name_or_path == "/tok"
    assert ns.use_fused_rmsnorm and ns.use_fused_rotary_pos_emb and ns.use_flash_attn and ns.reuse_fp32_param
    assert ns.context_parallel_algo == "ulysses_cp_algo"
    assert ns.spec == ["mindspeed_llm.tasks.models.spec.qwen3_spec", "layer_spec"]
    assert ns.first_k_dense_replace == -1 and ns.compress_ratios == [0, 0, 4]
    assert ns.moe_layer_freq == [0] * 3 + [1] * 11 and ns.window_size == (127, 0)


def test_attention_backend_takes_the_names_users_type():
    assert parse_megatron_args(["--attention-backend", "flash"]).attention_backend == "flash"
    assert parse_megatron_args([]).attention_backend == "auto"


def test_unknown_flags_are_listed_at_once_without_usage(capsys):
    with pytest.raises(UsageError) as err:
        parse_megatron(["--lr", "1e-4", "--no-such-flag", "--tensor-model-paralel-size", "2", "--other-unknown"])
    messages = err.value.messages
    assert any(m.startswith("--no-such-flag: not a Megatron-LM or MindSpeed-LLM argument — ") for m in messages)
    assert any("did you mean --tensor-model-parallel-size?" in m for m in messages)
    assert any(m.startswith("--other-unknown:") for m in messages)
    assert capsys.readouterr().err == ""  # argparse printed no usage


@pytest.mark.parametrize("argv, start", [
    (["--lr", "fast"], "--lr: invalid float value: 'fast' — "),
    (["--normalization", "BatchNorm"], "--normalization: invalid choice"),
    (["--seq-length"], "--seq-length: expected one argument — give it a value"),
])
def test_bad_values_become_one_line_errors(argv, start):
    with pytest.raises(UsageError) as err:
        parse_megatron(argv)
    assert err.value.messages[0].startswith(start)


def test_abbreviations_are_refused_like_megatron():
    with pytest.raises(UsageError):
        parse_megatron(["--tensor-model-parallel", "2"])


def test_given_flags_are_tracked_even_at_their_default():
    parsed = parse_megatron(["--tensor-model-parallel-size", "1", "--bf16"])
    assert parsed.given == {"tensor_model_parallel_size", "bf16"}


def test_no_torch_in_the_front_end():
    import subprocess
    import sys
    code = ("import sys, megatron_compat.parse.arguments, megatron_compat.translate; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
