"""The rules that moved into the one validation (`fsdp2_backend.config.validation`): one test each, through the
Megatron front end and `--dry-run` where a user meets them, and MindSpeed's spellings that validation accepts.

Before, these were found at run time (after the process group and the model existed) or not at all: e.g. a
`--dry-run` with `--tensor-model-parallel-size 3 --num-attention-heads 4` exited 0.
"""
import json
import os
import subprocess
import sys

import pytest

from fsdp2_backend.config import Config
from fsdp2_backend.config.model_facts import model_facts
from fsdp2_backend.config.validation import validate, validate_with_notices
from tests.support.launchers import REPO
from fsdp2_backend.usage_errors import UsageError

BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
        "--seq-length 32 --max-position-embeddings 64 --micro-batch-size 1 --train-iters 4 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 128 --swiglu --normalization RMSNorm --disable-bias-linear "
        "--position-embedding-type rope --attention-dropout 0 --hidden-dropout 0").split()
MOE = BASE + "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --qk-layernorm".split()


def dry_run(args, world):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WORLD_SIZE": str(world)}
    return subprocess.run([sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), *args, "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def refused(args, world, expected):
    result = dry_run(args, world)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert any(line.startswith(f"error: {expected}") for line in lines), lines


@pytest.mark.parametrize("args, world, expected", [
    (BASE + ["--tensor-model-parallel-size", "4"], 4,
     "parallel.tp_size (--tensor-model-parallel-size): num_key_value_heads=2 is not divisible by tp_size=4"),
    (BASE + ["--context-parallel-size", "2", "--context-parallel-algo", "megatron_cp_algo", "--seq-length", "30"],
     2, "data.cutoff_len: seq_length (--seq-length): 30 is not divisible by 4"),
    (BASE + ["--context-parallel-size", "8", "--context-parallel-algo", "ulysses_cp_algo"], 8,
     "parallel.cp_size (--context-parallel-size): Ulysses needs the attention heads"),
    (BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "33"], 2,
     "parallel.sequence_parallel (from --tensor-model-parallel-size, --sequence-parallel): the sequence length 33 "
     "(data.cutoff_len (from --seq-length))"),
    (MOE + ["--expert-model-parallel-size", "8"], 8,
     "parallel.ep_size (from --expert-model-parallel-size): 8 does not divide the model's 4 experts"),
    (MOE + ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 4,
     "parallel.ep_size (from --expert-model-parallel-size): with tp_size 2 the MoE layers split the sequence 33"),
    (BASE + ["--expert-model-parallel-size", "2"], 2,
     "parallel.ep_size (from --expert-model-parallel-size): the model (llama) has no experts"),
    (BASE + ["--split", "90,5,3,2"], 1, "data.split: '90,5,3,2' has 4 parts"),
    (BASE + ["--train-samples", "100"], 1, "training.max_steps / training.train_samples: give one training length"),
    (BASE + ["--lr", "1e-4", "--min-lr", "1e-3"], 1, "training.min_lr: 0.001 must lie in [0, lr=0.0001]"),
    (BASE + ["--lr", "1e-4", "--lr-warmup-iters", "4"], 1,
     "training.lr_warmup_iters (from --lr-warmup-iters): warmup (4 iterations)"),
])
def test_layout_and_megatron_rules_are_refused_by_the_dry_run(args, world, expected):
    refused(args, world, expected)


def test_the_tp_heads_case_of_the_issue():
    """`--tensor-model-parallel-size 3 --num-attention-heads 4` used to pass --dry-run."""
    args = " ".join(BASE).replace("--group-query-attention --num-query-groups 2 ", "").split()
    refused(args + ["--tensor-model-parallel-size", "3"], 3,
            "parallel.tp_size (--tensor-model-parallel-size): num_attention_heads=4 is not divisible by tp_size=3")
    assert dry_run(args + ["--tensor-model-parallel-size", "2"], 2).returncode == 0


def _fake_checkpoint(root, config_json):
    """The files that make a directory one of our complete checkpoints (no weights: validation reads none)."""
    checkpoint = root / "iter_0000006"
    (checkpoint / "hf_meta").mkdir(parents=True)
    (checkpoint / "checkpoint_meta.json").write_text("{}")
    (checkpoint / ".metadata").write_text("")
    (checkpoint / "hf_meta" / "config.json").write_text(json.dumps(config_json))
    (root / "latest_checkpointed_iteration.txt").write_text("6")
    return checkpoint


def _config(**training):
    config = Config()
    config.training.stage, config.data.data_manager_type, config.data.mock_data = "pt", "mg", True
    for name, value in training.items():
        setattr(config.training, name, value)
    return config


def test_a_resumed_runs_model_facts_come_from_its_checkpoint(tmp_path):
    _fake_checkpoint(tmp_path, {"model_type": "qwen3", "num_attention_heads": 8, "num_key_value_heads": 2,
                                "num_hidden_layers": 2, "vocab_size": 256})
    config = _config(resume_from_checkpoint=str(tmp_path), output_dir=str(tmp_path / "new"), max_steps=4)
    facts = model_facts(config, [])
    assert (facts.source, facts.num_heads, facts.num_kv_heads) == ("checkpoint", 8, 2)
    config.parallel.tp_size = 4
    with pytest.raises(UsageError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        validate(config, 4)


def test_an_empty_load_directory_needs_a_model_to_start_from(tmp_path):
    config = _config(resume_from_checkpoint=str(tmp_path / "empty"), output_dir=str(tmp_path / "empty"),
                     max_steps=4)
    with pytest.raises(UsageError, match="holds no checkpoint yet and no model is given"):
        validate(config)


def test_a_megatron_lm_checkpoint_is_named_for_what_it_is(tmp_path):
    (tmp_path / "iter_0000100").mkdir()
    (tmp_path / "iter_0000100" / "common.pt").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("100")
    refused(BASE + ["--load", str(tmp_path), "--save", str(tmp_path / "new")], 1,
            f"training.resume_from_checkpoint (--load): {tmp_path} holds a Megatron-LM distributed (torch_dist) "
            "checkpoint")


def test_mindspeed_spellings_validate(tmp_path):
    """save_steps 0 (no periodic saves), booleans written 1/0, fsdp_size counted with cp inside, an inline
    {file_name} dataset, data.template reported once as without effect in pretraining."""
    from fsdp2_backend.config.loading import build_config

    layers = [("yaml", {"training": {"stage": "pt", "save_steps": 0, "disable_shuffling": 1, "max_steps": 2,
                                     "output_dir": str(tmp_path), "log_throughput": True},
                        "data": {"data_manager_type": "mg", "template": "qwen3", "cutoff_len": 32,
                                 "dataset": {"file_name": "/data/train.parquet"}},
                        "parallel": {"fsdp_size": 8, "cp_size": 2},
                        "model": {"architecture": {"model_type": "qwen3", "num_attention_heads": 4,
                                                   "num_key_value_heads": 2}}})]
    config, notices = validate_with_notices(build_config(layers), 8)
    assert config.training.save_steps == 0 and config.training.disable_shuffling is True
    assert config.data.dataset == ["/data/train.parquet"]
    assert notices == ["data.template: no effect in pretraining (read by the SFT data path only)"]
    from fsdp2_backend.config import parallel_layout

    layout = parallel_layout(config.parallel, 8)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate, layout.cp) == (4, 4, 1, 2)
    assert parallel_layout(config.parallel.__class__(fsdp_size=4, cp_size=2), 8).dp_replicate == 2  # HSDP


def test_inline_dataset_keys_pretraining_does_not_read_are_reported():
    config = _config(max_steps=2, output_dir="/tmp/x")
    config.model.architecture = {"model_type": "qwen3"}
    config.data.mock_data, config.data.dataset = False, {"file_name": "/d/t.parquet", "formatting": "alpaca"}
    config, notices = validate_with_notices(config)
    assert notices == ["data.dataset.formatting: no effect in pretraining (only file_name is read)"]
    assert config.data.dataset == ["/d/t.parquet"]


def test_a_dataset_string_is_one_path_unless_it_is_a_blend():
    from fsdp2_backend.config.schema import dataset_entries

    assert dataset_entries("/data/with space/x_text_document") == ["/data/with space/x_text_document"]
    assert dataset_entries("0.3 /a 0.7 /b") == ["0.3", "/a", "0.7", "/b"]
    assert dataset_entries(["/a"]) == ["/a"] and dataset_entries({"file_name": "/f.parquet"}) == ["/f.parquet"]


def test_gradient_accumulation_is_derived_once_by_validation():
    config = _config(max_steps=2, global_batch_size=16, per_device_train_batch_size=2, output_dir="/tmp/x")
    config.model.architecture = {"model_type": "qwen3"}
    assert validate(config, 4).training.gradient_accumulation_steps == 2  # 16 / (2 x 4)


def test_a_step35_checkpoint_without_its_model_id_names_the_id(tmp_path):
    """transformers has no causal LM for model_type step3p5: one line saying which model_id builds it (before, a
    ValueError traceback from AutoModelForCausalLM at model build)."""
    from tests.support.step35_reference import step35_config_dict

    (tmp_path / "config.json").write_text(json.dumps(step35_config_dict()))
    config = Config()
    config.model.model_name_or_path = str(tmp_path)
    config.data.data_manager_type, config.data.mock_data = "mg", True
    config.training.output_dir = str(tmp_path / "out")
    with pytest.raises(UsageError) as err:
        validate(config)
    assert "model.model_id: the model (step3p5, from the hf directory) has no causal LM in transformers — set " \
           "model.model_id step35" in str(err.value)
    config.model.model_id = "step35"
    assert "model.model_id" not in _errors_of(config)


def _errors_of(config) -> str:
    try:
        validate(config)
    except UsageError as err:
        return str(err)
    return ""


def test_reset_attention_mask_alone_is_for_rotary_positions(tmp_path):
    """Per-document attention with Megatron's running positions is built by restarting the positions at each
    document (data/pretrain.py), which equals Megatron's result for rotary positions only: learned absolute
    positions (GPT-2) are refused; with reset_position_ids as well they are fine."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4).save_pretrained(str(tmp_path))
    config = Config()
    config.model.model_name_or_path, config.model.train_from_scratch = str(tmp_path), True
    config.data.data_manager_type, config.data.mock_data, config.data.cutoff_len = "mg", True, 32
    config.data.reset_attention_mask, config.data.append_eod = True, True
    config.training.output_dir = str(tmp_path / "out")
    assert "data.reset_attention_mask: per-document attention with running positions is built for rotary " \
           "positions only" in _errors_of(config)
    config.data.reset_position_ids = True
    assert "data.reset_attention_mask" not in _errors_of(config)


@pytest.mark.parametrize("model_type, expected", [
    ("gpt_oss", "set model.model_id gpt_oss for this gpt_oss model, or drop them"),
    ("deepseek_v2", "no model id here implements deepseek_v2's MoE; drop them")])
def test_router_options_on_a_transformers_model_name_the_id_or_say_none(tmp_path, model_type, expected):
    """Megatron's router options with model_id unset on a model type that is not promoted automatically: the
    line names the model id that carries the router, or says no id does (before, it asked for an id to set
    even where none exists)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "num_attention_heads": 4,
                                                      "hidden_size": 64, "num_hidden_layers": 2,
                                                      "vocab_size": 128}))
    config = Config()
    config.model.model_name_or_path, config.model.train_from_scratch = str(tmp_path), True
    config.model.moe_z_loss_coeff = 1e-3
    config.data.data_manager_type, config.data.mock_data = "mg", True
    config.training.output_dir = str(tmp_path / "out")
    assert expected in _errors_of(config)
