"""The native configuration: every seed field with the seed's default, typed loading, and each validation rule."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp2_backend.config import Config, GROUPS
from fsdp2_backend.config.loading import build_config, coerce, load_yaml, split_native_overrides, to_yaml
from fsdp2_backend.config.validation import normalise, validate
from fsdp2_backend.usage_errors import UsageError

from tests.support.configs import messages, pt_config

SEED = Path(__file__).resolve().parents[1] / "data" / "fsdp2_arguments_reference.txt"
SECTION_GROUP = {"ModelArguments": "model", "DataArguments": "data", "ParallelArguments": "parallel",
                 "TrainingArguments": "training", "profiling参数": "profiling", "InferenceArguments": "inference",
                 "OptimizationArguments": "optimization"}
REPO = Path(__file__).resolve().parents[2]


def _balanced(text):
    depth = 0
    for i, ch in enumerate(text):
        depth += ch in "[{(" and 1 or (-1 if ch in "]})" else 0)
        if ch == " " and depth == 0:
            return text[:i], text[i + 1:]
    return text, ""


def seed_fields():
    """(group, name, default text) for every row of the seed's reference tables, parsed from the seed file."""
    group, rows = None, []
    for line in SEED.read_text(encoding="utf-8").splitlines():
        for marker, name in SECTION_GROUP.items():
            if line.strip().endswith((f"（{marker}）", marker)) and len(line) < 40:
                group = name
        m = re.match(r"^([a-z_][a-z0-9_]*) (.*)$", line)
        if not m or group is None:
            continue
        name, rest = m.groups()
        tp, rest = _balanced(rest)
        if not re.match(r"^(Optional|Literal|List|Dict|Union|str|int|float|bool)", tp):
            continue
        default = rest[:rest.index('"', 1) + 1] if rest.startswith('"') else _balanced(rest)[0]
        rows.append((group, name, tp, default))
    return rows


def _seed_value(tp, text):
    if text == "无（必填）":  # required, no default
        return None
    if tp in ("str", "Optional[str]") and text != "None":
        return text.strip('"')
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def test_every_seed_field_present_with_seed_default():
    rows = seed_fields()
    assert len(rows) == 136
    defaults = Config().to_dict()
    for group, name, tp, default in rows:
        assert name in defaults[group], f"{group}.{name} missing"
        assert defaults[group][name] == _seed_value(tp, default), f"{group}.{name}"


def test_valid_pretraining_config_passes():
    assert validate(pt_config()).training.stage == "pt"


@pytest.mark.parametrize("groups, expected", [
    ({"model": {"model_name_or_path": None}}, "model.model_name_or_path: required"),
    ({"training": {"output_dir": None}}, "training.output_dir: required"),
    ({"data": {"eval_dataset": "x", "val_size": 0.1}}, "data.eval_dataset / data.val_size: exclusive"),
    ({"data": {"train_on_prompt": True, "mask_history": True}}, "data.train_on_prompt / data.mask_history"),
    ({"data": {"streaming": True, "max_samples": 5}}, "data.streaming / data.max_samples: exclusive"),
    ({"data": {"streaming": True, "val_size": 0.5}}, "data.val_size: must be an integer under streaming"),
    ({"optimization": {"use_triton_gdn": True, "use_flash_gdn": True}}, "optimization.use_triton_gdn / optimization.use_flash_gdn: at most one"),
    ({"data": {"reset_attention_mask": True}}, "data.reset_attention_mask: needs data.append_eod"),
    ({"parallel": {"fsdp_modules": []}}, "parallel.fsdp_modules: must not be empty"),
    ({"data": {"interleave_probs": "0.5,0.5"}}, "data.interleave_probs: only used with mix_strategy interleave"),
    ({"profiling": {"profile_step_start": 5, "profile_step_end": 5}}, "profiling.profile_step_end: must be -1 or"),
    ({"training": {"stage": "sft"}}, "training.stage: sft reads the fine-tuning data path — set "
                                     "data.data_manager_type: lf"),
    ({"model": {"quant_recipe_name": "mxfp8", "quant_converters": ["x"]}}, "model.quant_converters: unknown"),
    ({"parallel": {"ep_dispatcher": "mc2", "ep_size": 2}}, "parallel.ep_dispatcher: mc2 needs Ascend NPUs"),
    ({"training": {"decoupled_min_lr": 1e-5}}, "training.decoupled_min_lr: only used with training.decoupled_lr"),
    ({"training": {"decoupled_lr": -1.0}}, "training.decoupled_lr: must be >= 0"),
    ({"training": {"start_weight_decay": 0.0}}, "training.start_weight_decay: only used with weight_decay_incr_style"),
    ({"training": {"weight_decay_incr_style": "linear", "end_weight_decay": 0.1}},
     "training.weight_decay_incr_style: linear needs both"),
    ({"training": {"weight_decay_incr_style": "cosine", "start_weight_decay": 0.2, "end_weight_decay": 0.1}},
     "training.start_weight_decay: 0.2 exceeds end_weight_decay"),
    ({"training": {"exit_duration_in_mins": 0}}, "training.exit_duration_in_mins: must be positive"),
])
def test_each_rule_has_its_message(groups, expected):
    found = messages(pt_config(**groups))
    assert any(m.startswith(expected) for m in found), found


def test_model_id_error_lists_registered_ids():
    from typing import get_args, get_type_hints

    from fsdp2_backend.config.schema import MODEL_ID_ALIASES, ModelArguments
    from fsdp2_backend.config.validation import registered_model_ids

    # other names of an id (MindSpeed v26.1.0's longcat_flash) resolve to a registered id: not ids of their own
    assert {model_id for model_id, _ in MODEL_ID_ALIASES.values()} <= set(registered_model_ids())
    seed_ids = [i for i in get_args(get_args(get_type_hints(ModelArguments)["model_id"])[0])
                if i not in MODEL_ID_ALIASES]
    missing = [i for i in seed_ids if i not in registered_model_ids()]
    if not missing:  # every seed id is implemented: nothing left to refuse
        assert set(seed_ids) <= set(registered_model_ids())
        return
    found = messages(pt_config(model={"model_id": missing[0]}))
    assert any("qwen3" in m.split("registered:")[1] for m in found if "registered:" in m)


def test_every_problem_reported_at_once():
    found = messages(pt_config(model={"model_name_or_path": None}, training={"output_dir": None},
                               data={"train_on_prompt": True, "mask_history": True}))
    assert len(found) >= 3


@pytest.mark.parametrize("world, parallel, training, expected", [
    (4, {"tp_size": 3}, {}, "parallel.tp_size x parallel.cp_size: the world size 4 is not divisible"),
    (8, {"tp_size": 2, "cp_size": 2}, {"global_batch_size": 6, "per_device_train_batch_size": 2},
     "training.global_batch_size: 6 is not divisible by micro batch 2 x data-parallel size 2"),
    (4, {"ep_size": 3}, {}, "parallel.ep_size x parallel.ep_fsdp_size: 3 x 1 does not divide the world size 4"),
    (8, {"fsdp_size": 3}, {}, "parallel.fsdp_size: 3 does not divide the data-parallel size 8"),
])
def test_size_arithmetic(world, parallel, training, expected):
    found = messages(pt_config(parallel=parallel, training=training), world)
    assert any(m.startswith(expected) for m in found), found


def test_global_batch_derives_accumulation():
    config = validate(pt_config(parallel={"tp_size": 2}, training={"global_batch_size": 32,
                                                                    "per_device_train_batch_size": 2}), 8)
    assert config.training.gradient_accumulation_steps == 32 // (2 * 4)


def test_neat_packing_implies_packing():
    assert normalise(pt_config(data={"neat_packing": True}), 1).data.packing is True


@pytest.mark.parametrize("value, tp, expected", [
    ("true", bool, True), ("0", bool, False), ("3", int, 3), ("1e-4", float, 1e-4),
    ("none", "Optional[int]", None), ("a b c", "List[str]", ["a", "b", "c"]), ('["x", "y"]', "List[str]", ["x", "y"]),
    ('{"file_name": "x.json", "formatting": "alpaca"}', "Optional[Union[Dict[str, Any], str]]",
     {"file_name": "x.json", "formatting": "alpaca"}),
    ("0.5 /data/a 0.5 /data/b", "Optional[Union[Dict[str, Any], str]]", "0.5 /data/a 0.5 /data/b"),
])
def test_coercion(value, tp, expected):
    from typing import Any, Dict, List, Optional, Union  # noqa: F401 (names for eval)
    assert coerce(value, eval(tp) if isinstance(tp, str) else tp) == expected


@pytest.mark.parametrize("group, name, value", [
    ("parallel", "cp_type", "zigzag"), ("training", "max_steps", "ten"), ("training", "save_async", "maybe"),
    ("parallel", "param_dtype", "fp8"),
])
def test_bad_types_named(group, name, value):
    with pytest.raises(UsageError) as info:
        build_config([("cli", {group: {name: value}})])
    assert info.value.messages[0].startswith(f"{group}.{name}: expected")


def test_grouped_overrides_split_from_other_flags():
    overrides, rest = split_native_overrides(["--parallel.tp_size", "2", "--lr", "1e-4", "--parallel.fsdp_modules",
                                              "a", "b", "--training.save_async", "--data.dataset={\"k\": 1}"])
    assert overrides == {"parallel": {"tp_size": "2", "fsdp_modules": ["a", "b"]},
                         "training": {"save_async": "true"}, "data": {"dataset": '{"k": 1}'}}
    assert rest == ["--lr", "1e-4"]


def test_mapping_overrides_take_yaml_as_the_help_says():
    overrides, _ = split_native_overrides(["--model.architecture", "{model_type: qwen3, hidden_size: 48}",
                                           "--data.dataset", "{file_name: chat.jsonl, formatting: sharegpt}"])
    config = build_config([("--group.field overrides", overrides)])
    assert config.model.architecture == {"model_type": "qwen3", "hidden_size": 48}
    assert config.data.dataset == {"file_name": "chat.jsonl", "formatting": "sharegpt"}
    with pytest.raises(UsageError, match=r"model.architecture.*expected a YAML or JSON mapping"):
        build_config([("x", {"model": {"architecture": "{model_type: [qwen3}"}})])


def test_yaml_round_trip(tmp_path):
    config = validate(pt_config(parallel={"fsdp_modules": ["model.layers.{*}"]}, data={"dataset": "0.3 /a 0.7 /b"}))
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(config))
    assert build_config([(str(path), load_yaml(str(path)))]) == config


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  model_name_or_path: /m\ntraining: [unclosed\n  lr: 1\n")
    with pytest.raises(UsageError) as info:
        load_yaml(str(path))
    assert re.match(rf"{re.escape(str(path))} line \d+: malformed YAML", info.value.messages[0])


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, str(REPO / "pretrain_fsdp2.py"), *args], capture_output=True, text=True,
                          cwd=REPO, env=env)


def test_cli_errors_exit_2_without_traceback(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(pt_config()))
    result = run_cli(str(path), "--parallel.cp_type", "zigzag", "--training.stage", "sft", "--dry-run")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: parallel.cp_type: expected one of")


def test_cli_dry_run_prints_loadable_yaml(tmp_path):
    from transformers import Qwen3Config

    from tests.support.megatron_reference import write_corpus

    # --dry-run checks the input files are there: a model directory's config.json and a data prefix
    (tmp_path / "model").mkdir()
    Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path / "model")
    paths = {"model": {"model_name_or_path": str(tmp_path / "model")},
             "data": {"dataset": write_corpus(str(tmp_path / "d"), 4, seed=0, vocab_size=128)}}
    path = tmp_path / "c.yaml"
    path.write_text(to_yaml(pt_config(**paths)))
    result = run_cli(str(path), "--parallel.fsdp_size", "1", "--training.lr", "3e-4", "--dry-run")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "out.yaml"
    out.write_text(result.stdout)
    again = build_config([(str(out), load_yaml(str(out)))])
    assert again.training.lr == 3e-4 and again == validate(pt_config(training={"lr": 3e-4}, **paths))


def test_megatron_flag_and_native_field_in_conflict_named(tmp_path):
    result = run_cli("--lr", "1e-4", "--training.lr", "2e-4", "--train-iters", "5", "--mock-data",
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--num-layers", "2",
                     "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                     "--max-position-embeddings", "32", "--micro-batch-size", "1", "--dry-run")
    assert result.returncode == 2
    assert "training.lr: set two different ways — --lr gives 0.0001, --group.field overrides gives 0.0002" in \
        result.stderr


def test_native_override_beats_megatron_default_and_dry_run_sizes_world():
    import os

    env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
    result = run_cli("--training.seed", "7", "--train-iters", "5", "--mock-data", "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                     "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                     "--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--dry-run", env=env)
    assert result.returncode == 0, result.stderr
    assert "  seed: 7\n" in result.stdout
    assert "# validated for world size 4 " in result.stdout


def test_expert_parallel_selects_the_stacked_expert_model():
    arch = {"model_type": "qwen3_moe", "num_experts": 4}
    config = validate(pt_config(model={"model_name_or_path": None, "architecture": arch},
                                parallel={"ep_size": 2}), 2)
    assert config.model.model_id == "qwen3_moe"
    assert validate(pt_config(model={"model_name_or_path": None, "architecture": arch})).model.model_id is None


@pytest.mark.parametrize("group, name, value, expected", [
    ("model", "ms_hub_token", "x", "model.ms_hub_token: downloads from ModelScope are not supported"),
    ("model", "quant_converters", ["a"], "model.quant_converters: only used with model.quant_recipe_name"),
])
def test_fields_without_an_effect_here_are_declined(group, name, value, expected):
    found = messages(pt_config(**{group: {name: value}}))
    assert any(m.startswith(expected) for m in found), found


@pytest.mark.parametrize("name, value", [("buffer_size", 8), ("template", "qwen3")])
def test_sft_fields_in_pretraining_are_accepted_and_reported_once(name, value):
    """MindSpeed's pretraining YAMLs set data.template: accepted, with one notice saying it has no effect."""
    from fsdp2_backend.config.validation import validate_with_notices

    _, notices = validate_with_notices(pt_config(data={name: value}))
    assert notices == [f"data.{name}: no effect in pretraining (read by the SFT data path only)"]
