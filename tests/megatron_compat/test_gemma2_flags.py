"""MindSpeed-LLM's Gemma-2 launch line (examples/mcore/gemma2/pretrain_gemma2_9b_ptd.sh, in the launch corpus)
builds transformers' Gemma-2, and a model flag a line lacks is said, not silently replaced.

The expected keys are written from MindSpeed's documented layer (megatron_compat/architecture/gemma2.py's
docstring: sliding layers are Megatron's 1-based odd layers, the softcaps C·tanh(x/C), the score scale
S^-1/2), with values no default would give (scalar 24 for 16-wide heads, caps 7.5 and 11, window 8 over 3 layers).
"""
import json
from pathlib import Path

import pytest

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.translate import translate_megatron
from tests.support.launchers import run_pretrain
from tests.support.tiny_models import tiny_model_dir

LINE = json.loads((Path(__file__).resolve().parents[1] / "data" / "launch_corpus.json").read_text())[
    "mindspeed-llm:examples/mcore/gemma2/pretrain_gemma2_9b_ptd.sh"]
SMALL = {"--tensor-model-parallel-size": "1", "--num-layers": "3", "--hidden-size": "64", "--ffn-hidden-size": "96",
         "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
         "--query-pre-attn-scalar": "24", "--output-logit-softcapping": "7.5", "--interleave-sliding-window": "8",
         "--seq-length": "32", "--max-position-embeddings": "64", "--global-batch-size": "4", "--train-iters": "3",
         "--lr": "1e-3", "--min-lr": "1e-4"}
PATHS = ("--tokenizer-name-or-path", "--data-path", "--load", "--save")


def _line(tmp_path, drop=(), **values):
    """The corpus line at toy sizes, its placeholder paths replaced (or dropped), flags in `drop` removed."""
    argv, out, i = list(LINE), [], 0
    while i < len(argv):
        flag, value = argv[i], argv[i + 1] if i + 1 < len(argv) else None
        takes = value is not None and not value.startswith("--")
        if flag in drop or flag in PATHS:
            i += 2 if takes else 1
            continue
        out += [flag] + ([SMALL.get(flag, value)] if takes else [])
        i += 2 if takes else 1
    out += ["--attn-logit-softcapping", "11"]
    for flag, value in values.items():
        out += [flag] + ([value] if value is not None else [])
    return out


def test_the_line_builds_gemma2_with_mindspeeds_meaning(tmp_path):
    from fsdp2_backend.models.loading import load_hf_config

    tokenizer = tiny_model_dir(tmp_path / "tok", seed=1)
    fields = translate_megatron(_line(tmp_path, **{"--tokenizer-name-or-path": tokenizer})).fields
    arch = fields["model"]["architecture"]
    expected = dict(model_type="gemma2", query_pre_attn_scalar=24, final_logit_softcapping=7.5,
                    attn_logit_softcapping=11.0, sliding_window=8, hidden_activation="gelu_pytorch_tanh",
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"], head_dim=16,
                    num_key_value_heads=2, intermediate_size=96, attention_bias=False, tie_word_embeddings=True)
    assert {k: arch.get(k) for k in expected} == expected
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    hf = load_hf_config(config.model)
    assert type(hf).__name__ == "Gemma2Config" and hf.query_pre_attn_scalar == 24 and hf.sliding_window == 8


def test_absent_caps_and_window_are_none_not_transformers_defaults(tmp_path):
    drop = ("--output-logit-softcapping", "--interleave-sliding-window", "--query-pre-attn-scalar")
    argv = [a for a in _line(tmp_path, drop=drop) if a not in ("--attn-logit-softcapping", "11")]
    arch = translate_megatron(argv + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]).fields[
        "model"]["architecture"]
    assert arch["final_logit_softcapping"] is None and arch["attn_logit_softcapping"] is None
    assert arch["layer_types"] == ["full_attention"] * 3 and arch["query_pre_attn_scalar"] == 16  # 1/sqrt(head)


def test_a_gemma2_line_missing_a_fixed_part_is_declined_by_name(tmp_path):
    with pytest.raises(UsageError) as info:
        translate_megatron(_line(tmp_path, drop=("--add-rmsnorm-offset",)) +
                           ["--tokenizer-type", "NullTokenizer", "--vocab-size", "300"])
    assert [m.split(":")[0] for m in info.value.messages] == ["--add-rmsnorm-offset"], info.value.messages


def test_model_flags_a_line_lacks_are_said():
    """Megatron's default MLP is not gated and its default norm is LayerNorm: a from-scratch rope line without
    --swiglu / --normalization RMSNorm describes a model HF's Llama is not (was built as Llama silently)."""
    line = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 64 --seq-length 32 "
            "--position-embedding-type rope --disable-bias-linear --micro-batch-size 1 --global-batch-size 2 "
            "--train-iters 2 --lr 1e-4 --tokenizer-type NullTokenizer --vocab-size 300 --mock-data").split()
    with pytest.raises(UsageError) as info:
        translate_megatron(line)
    assert sorted(m.split(":")[0] for m in info.value.messages) == ["--normalization", "--swiglu"]


def test_the_loaded_directory_is_checked_against_the_gemma2_flags(tmp_path):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from fsdp2_backend.launch import parse_command_line

    model_dir = tmp_path / "gemma2"
    tiny_model_dir(model_dir, seed=2)
    hf = Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                      final_logit_softcapping=7.5, attn_logit_softcapping=11.0, max_position_embeddings=64)
    Gemma2ForCausalLM(hf).save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    argv = _line(tmp_path, **{"--load": str(model_dir), "--tokenizer-name-or-path": str(model_dir),
                               "--mock-data": None, "--save": str(tmp_path / "save")})
    with pytest.raises(UsageError) as info:
        parse_command_line(argv, 1)
    assert any(m.startswith("model.architecture.query_pre_attn_scalar (from --query-pre-attn-scalar)")
               for m in info.value.messages), info.value.messages


def test_the_line_trains(tmp_path):
    tokenizer = tiny_model_dir(tmp_path / "tok", seed=3)
    argv = _line(tmp_path, **{"--tokenizer-name-or-path": tokenizer, "--mock-data": None, "--bf16": None})
    argv = [a for a in argv if a not in ("--bf16", "--use-flash-attn")]
    lines, log = run_pretrain(argv, tmp_path / "save")
    assert sorted(lines) == [1, 2, 3] and all(0 < float(loss) < 20 for _, loss in lines.values()), log[-2000:]
    (saved,) = (tmp_path / "save").glob("iter_*/hf_meta/config.json")
    assert json.loads(saved.read_text())["model_type"] == "gemma2"
