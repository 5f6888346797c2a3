"""MindSpeed-LLM's own FSDP2 YAML files and launchers run unchanged: the Qwen3 and Qwen3-MoE pretraining configs.

tests/data/mindspeed_fsdp2/ holds verbatim copies of MindSpeed-LLM's files (file name = repository path with '/'
replaced by '__'): `f88dd26d/` (commit f88dd26d, files that differ from HEAD or are gone there), `head/`
(commit c77308a1), `v26.1.0/` (the release, branch and tag 26.1.0: files that differ from master's) and
`launchers.json` ({commit: {launcher .sh: {yaml, args, world}}}: the YAML a launcher runs,
the `--group.field value` arguments it adds and the world size it runs at).

For every launcher in scope, with only its paths replaced (model and tokenizer → a directory holding the real
model's config.json and a tiny tokenizer, the dataset → a small parquet file of raw text, output_dir → tmp):
- `pretrain_fsdp2.py YAML ARGS --dry-run` at the launcher's world size validates and prints the config as YAML;
- one launcher per (commit, model family) trains 3 steps on 2 gloo ranks, scaled down by overrides appended to
  its arguments, from the raw parquet text as MindSpeed does, and prints 3 Megatron log lines with finite losses.
SFT launchers (`tune_*`, stage sft with the lf data path) dry-run the same way and train 3 steps on 2 ranks from
an alpaca parquet file (tests/test_sft_*.py test the SFT path itself). The mxfp8 launchers
(`--model.quant_recipe_name mxfp8`) dry-run with their quant fields (tests/test_mx_*.py train with them).
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.launchers import REPO, free_port
from tests.support.tiny_models import tiny_model_dir, train_bytelevel_tokenizer
from tests.support.launchers import failure_report, run_command, train_lines

DATA = Path(__file__).resolve().parents[1] / "data" / "mindspeed_fsdp2"
COMMITS = ("f88dd26d", "head", "v26.1.0")  # v26.1.0: the release (branch and tag 26.1.0), besides master

# Published Hugging Face config.json values of the models the launchers name, written as the hub's files are
# (transformers 4.51 keys: num_experts, rope_theta), not re-serialised by the installed transformers.
QWEN3_DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
                   attention_dropout=0.0, bos_token_id=151643, eos_token_id=151645, head_dim=128, hidden_act="silu",
                   initializer_range=0.02, max_position_embeddings=40960, rms_norm_eps=1e-06, rope_scaling=None,
                   rope_theta=1000000, sliding_window=None, torch_dtype="bfloat16", transformers_version="4.51.0",
                   use_cache=True, use_sliding_window=False, vocab_size=151936)
QWEN3_MOE = dict(QWEN3_DENSE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
                 tie_word_embeddings=False)
REAL_MODELS = {
    "Qwen3-1.7B": dict(QWEN3_DENSE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       max_window_layers=28, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "Qwen3-8B": dict(QWEN3_DENSE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     max_window_layers=36, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-14B": dict(QWEN3_DENSE, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      max_window_layers=40, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-32B": dict(QWEN3_DENSE, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      max_window_layers=64, num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(QWEN3_MOE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          max_window_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768),
    "Qwen3-235B-A22B": dict(QWEN3_MOE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            max_window_layers=94, num_attention_heads=64, num_key_value_heads=4, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=1536),
}
# MindSpeed's CI runs a 2-layer cut of Qwen3-30B-A3B (/data/ci/models/Qwen3-30B-A3B/hf/Qwen3-30B-A3B-layer2/).
REAL_MODELS["Qwen3-30B-A3B-layer2"] = dict(REAL_MODELS["Qwen3-30B-A3B"], num_hidden_layers=2, max_window_layers=2)

# One launcher per (commit, model family) trains on 2 ranks; the others only dry-run.
TRAINED = {
    ("f88dd26d", "tests__st__shell_scripts__pretrain_qwen3_8b_4k_fsdp2.sh"),            # cp 2 ring, save_steps 0
    ("f88dd26d", "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_A3.sh"),      # paths in the YAML
    ("head", "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh"),               # head-only YAML
    ("head", "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh"),         # EP 2
    ("v26.1.0", "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh"),            # release-only YAML
    ("v26.1.0", "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh"),      # release-only, EP 2
}
# Fields holding a path on the user's machine: (group, field).
PATH_FIELDS = (("model", "model_name_or_path"), ("model", "tokenizer_name_or_path"), ("data", "dataset"),
               ("training", "output_dir"))


def _in_scope(name: str) -> bool:
    name = name.lower()
    return (("qwen3_" in name or "qwen3-30b" in name) and "qwen3_next" not in name and "qwen3-next" not in name
            and ("pretrain" in name or "tune_" in name))


# Where a commit's unchanged files are copied: head's and the release's files that are not in their folder are
# f88dd26d's (byte for byte: checked against the release branch's files).
FALLBACK = {"f88dd26d": ("f88dd26d",), "head": ("head", "f88dd26d"), "v26.1.0": ("v26.1.0", "f88dd26d")}


def _yaml_file(commit: str, repo_path: str):
    """The copied YAML a launcher runs: its commit's copy, else the same file of the next folder (FALLBACK);
    None when none has it."""
    name = repo_path[2:] if repo_path.startswith("./") else repo_path
    name = name.replace("/", "__")
    for where in FALLBACK[commit]:
        if (DATA / where / name).is_file():
            return DATA / where / name
    return None


def _launchers():
    """(commit, launcher, entry, yaml file or None) for every launcher in scope."""
    table = json.loads((DATA / "launchers.json").read_text())
    out = []
    for commit in COMMITS:
        for launcher, entry in sorted(table[commit].items()):
            if _in_scope(launcher) or _in_scope(entry["yaml"]):
                out.append((commit, launcher, entry, _yaml_file(commit, entry["yaml"])))
    return out


LAUNCHERS = _launchers()
MAPPED = [case for case in LAUNCHERS if case[3] is not None]
UNMAPPED = [(commit, launcher, entry["yaml"]) for commit, launcher, entry, path in LAUNCHERS if path is None]
PRETRAIN = [case for case in MAPPED if "tune_" not in case[1]]
SFT = [case for case in MAPPED if "tune_" in case[1]]


def _ids(cases):
    return [f"{commit}:{launcher[:-3]}" for commit, launcher, *_ in cases]


def _real_model(yaml_name: str) -> str:
    """The model a YAML is written for, from its file name."""
    name = yaml_name.lower()
    if "qwen3-30b" in name and "tests__pipeline" in name:
        return "Qwen3-30B-A3B-layer2"
    for key, model in (("235b", "Qwen3-235B-A22B"), ("30b", "Qwen3-30B-A3B"), ("32b", "Qwen3-32B"),
                       ("14b", "Qwen3-14B"), ("8b", "Qwen3-8B"), ("1point7b", "Qwen3-1.7B"), ("1p7b", "Qwen3-1.7B")):
        if key in name:
            return model
    raise AssertionError(f"no model known for {yaml_name}")


def _family(yaml_name: str) -> str:
    return "qwen3_moe" if _real_model(yaml_name).startswith(("Qwen3-30B", "Qwen3-235B")) else "qwen3"


def _with_paths(yaml_file: Path, args, paths):
    """The launcher's arguments with each path replaced where the launcher gives it, and the paths the YAML
    itself holds overridden after them (as a user pointing the files at their own machine would)."""
    args = list(args)
    in_yaml = yaml.safe_load(yaml_file.read_text(encoding="utf-8")) or {}
    for (group, field), value in zip(PATH_FIELDS, paths):
        flag = f"--{group}.{field}"
        if flag in args:
            args[args.index(flag) + 1] = value
        elif field in (in_yaml.get(group) or {}):
            args += [flag, value]
    return args


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny tokenizer, a parquet file of raw text ("text" column, like the alpaca parquet's) and lazily built
    model directories: `real(name)` (the real model's config.json + the tokenizer) and `tiny(family)`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp2_backend.cli.demo_assets import stdlib_texts

    root = tmp_path_factory.mktemp("mindspeed_assets")
    parquet = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": stdlib_texts(max_files=64, max_chars=2000)}), str(parquet))
    tokenizer = train_bytelevel_tokenizer(root / "tokenizer", vocab_size=300)
    built = {}

    def real(name):
        if name not in built:
            path = root / name
            path.mkdir()
            (path / "config.json").write_text(json.dumps(REAL_MODELS[name], indent=2) + "\n")
            tokenizer.save_pretrained(str(path))
            built[name] = str(path)
        return built[name]

    def tiny(family):
        key = f"tiny-{family}"
        if key not in built:
            path = root / key
            if family == "qwen3":
                tiny_model_dir(path, seed=0, vocab_size=300)
            else:
                tiny_qwen3_moe_dir(path, seed=0, vocab_size=300)
            built[key] = str(path)
        return built[key]

    return {"root": root, "parquet": str(parquet), "real": real, "tiny": tiny}


def tiny_qwen3_moe_dir(path, seed: int, vocab_size: int = 300) -> str:
    """An HF directory holding a locally trained tokenizer and a seeded tiny Qwen3-MoE (4 experts, top 2)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tokenizer = train_bytelevel_tokenizer(path, vocab_size=vocab_size)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=10000.0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(path))
    return str(path)


def _dry_run(assets, tmp_path, yaml_file, entry):
    model = assets["real"](_real_model(yaml_file.name))
    dataset = json.dumps({"file_name": assets["parquet"]})
    args = _with_paths(yaml_file, entry["args"], (model, model, dataset, str(tmp_path / "output")))
    command = [sys.executable, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args, "--dry-run"]
    return command, run_command(command, {"WORLD_SIZE": str(entry["world"])}, timeout=300)


def test_every_launcher_in_scope_maps_to_a_copied_yaml():
    """Launchers whose YAML path names no copied file (MindSpeed's own launcher points at a file that does not
    exist) are listed here rather than silently dropped; the list is what upstream ships today."""
    assert len(PRETRAIN) == 27 and len(SFT) == 2, _ids(PRETRAIN + SFT)
    assert sorted(launcher for _, launcher, _ in UNMAPPED) == [
        "examples__fsdp2__qwen3__pretrain_qwen3_1point7b_4k_fsdp2_A2.sh",
        "examples__fsdp2__qwen3__tune_qwen3_1point7b_4k_fsdp2_A2.sh"], UNMAPPED
    # the release's launchers run its own copies where the release's files differ from master's
    release = {launcher: path.parent.name for commit, launcher, _, path in MAPPED if commit == "v26.1.0"}
    assert [name for name, where in sorted(release.items()) if where == "v26.1.0"] == [
        "examples__fsdp2__qwen3__pretrain_qwen3_8b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3__tune_qwen3_8b_4k_fsdp2_A2.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_235b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_A3.sh",
        "examples__fsdp2__qwen3_moe__pretrain_qwen3_30b_4k_fsdp2_quant_A5.sh"], release


QUANT = [case for case in PRETRAIN if "--model.quant_recipe_name" in case[2]["args"]]
FULL_PRECISION = [case for case in PRETRAIN if case not in QUANT]


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", QUANT, ids=_ids(QUANT))
def test_mxfp8_launcher_dry_runs_with_its_quant_fields(assets, tmp_path, commit, launcher, entry, yaml_file):
    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    model = yaml.safe_load(result.stdout)["model"]
    assert model["quant_recipe_name"] == "mxfp8" and model["enable_fsdp_low_precision_all_gather"] is True
    assert model["quant_converters"] == ["quantize.linear.mx", "quantize.moe.mx"]


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", FULL_PRECISION, ids=_ids(FULL_PRECISION))
def test_dry_run_at_launcher_world_size(assets, tmp_path, commit, launcher, entry, yaml_file):
    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    printed = yaml.safe_load(result.stdout)
    assert isinstance(printed, dict) and printed["training"]["stage"] == "pt", result.stdout[-2000:]
    assert printed["model"]["model_name_or_path"] == assets["real"](_real_model(yaml_file.name))
    assert printed["training"]["output_dir"] == str(tmp_path / "output")


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", SFT, ids=_ids(SFT))
def test_sft_launcher_dry_runs_and_trains_on_two_ranks(assets, tmp_path, commit, launcher, entry, yaml_file):
    """MindSpeed's qwen3 tune YAML (stage sft, template qwen3, an inline alpaca dataset), paths replaced: its
    dry run at the launcher's world size prints stage sft, and scaled down it trains 3 steps on 2 gloo ranks."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp2_backend.training.logging import parse_train_line
    from tests.support.sft_assets import alpaca_rows

    command, result = _dry_run(assets, tmp_path, yaml_file, entry)
    assert result.returncode == 0, failure_report(result, command)
    assert yaml.safe_load(result.stdout)["training"]["stage"] == "sft", result.stdout[-2000:]
    if commit == "v26.1.0":  # the release's copy differs from master's in its paths and sizes only: dry run alone
        return
    parquet = tmp_path / "train-00000-of-00001-a09b74b3ef9c3b56.parquet"
    pq.write_table(pa.Table.from_pylist(alpaca_rows(32)), str(parquet))
    model, output = assets["tiny"]("qwen3"), str(tmp_path / "output")
    dataset = json.dumps({"file_name": str(parquet), "formatting": "alpaca"})
    args = _with_paths(yaml_file, entry["args"], (model, model, dataset, output))
    args += ["--model.model_name_or_path", model, "--parallel.fsdp_size", "2", "--training.max_steps", "3",
             "--data.cutoff_len", "64", "--training.per_device_train_batch_size", "1",
             "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
             "--training.output_dir", output, "--training.dataloader_num_workers", "0"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args]
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    assert all(math.isfinite(line["losses"]["lm loss"]) for line in lines)


TRAIN_CASES = [case for case in PRETRAIN if (case[0], case[1]) in TRAINED]


def _scaled_ep(entry) -> str:
    args = entry["args"]
    ep = int(args[args.index("--parallel.ep_size") + 1]) if "--parallel.ep_size" in args else 1
    return "2" if ep > 1 else "1"


@pytest.mark.parametrize("commit,launcher,entry,yaml_file", TRAIN_CASES, ids=_ids(TRAIN_CASES))
def test_trains_three_steps_on_two_ranks(assets, tmp_path, commit, launcher, entry, yaml_file):
    from fsdp2_backend.training.logging import parse_train_line

    model = assets["tiny"](_family(yaml_file.name))
    dataset = json.dumps({"file_name": assets["parquet"]})
    output = str(tmp_path / "output")
    args = _with_paths(yaml_file, entry["args"], (model, model, dataset, output))
    args += ["--model.model_name_or_path", model, "--parallel.fsdp_size", "2",
             "--parallel.ep_size", _scaled_ep(entry), "--parallel.ep_fsdp_size", "1",
             "--training.max_steps", "3", "--data.cutoff_len", "64", "--training.per_device_train_batch_size", "1",
             "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
             "--training.output_dir", output]  # the YAML's own data loader workers
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args]
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    for line in lines:
        loss = line["losses"].get("lm loss")
        assert loss is not None and math.isfinite(loss), line
