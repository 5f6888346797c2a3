"""MindSpeed-LLM's other qwen3_next YAMLs (tests/data/mindspeed_fsdp2) through the entry point, paths replaced:
- the SFT tune YAML (`tune_qwen3_next_16k_fsdp2_A3`, head's launcher arguments with head's copy, and the
  f88dd26d copy that holds its paths and optimization fields itself): a tiny Qwen3-Next HF directory and a
  tiny alpaca parquet, 3 steps on 2 gloo ranks;
- the AscendC GDN CI case (`qwen3_next_ascendc-GDN_pack_cp2`: packed documents through the mg data manager,
  Ulysses cp 2): its `use_flash_gdn: True` cannot run off NPU — the run stops with one line saying so, and with
  only that flag turned off it trains 3 steps on 2 ranks with cp 2.
The overrides each test appends (sizes scaled down, paths) are listed in the test: nothing else is changed.
"""
import json
import math
import os

import pytest

from tests.support.launchers import REPO, torchrun_command
from tests.support.launchers import failure_report, run_command, train_lines
from tests.support.mindspeed_yaml import DATA, with_paths, yaml_file_at
from tests.support.mindspeed_yaml import assets  # noqa: F401  (pytest fixture)
from tests.support.tiny_models import tiny_next_dir

SCALED = ["--training.max_steps", "3", "--data.cutoff_len", "64", "--training.per_device_train_batch_size", "1",
          "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
          "--optimization.chunk_loss_size", "32", "--training.dataloader_num_workers", "0"]


@pytest.fixture(scope="module")
def tiny_next(tmp_path_factory):
    return tiny_next_dir(tmp_path_factory.mktemp("qwen3-next"))


def _command(yaml_file, args):
    return torchrun_command(2, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args)


def _three_steps(result, command):
    from fsdp2_backend.training.logging import parse_train_line

    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    assert all(math.isfinite(line["losses"]["lm loss"]) for line in lines)
    return result.stdout + result.stderr


@pytest.mark.parametrize("commit", ["head", "f88dd26d"])
def test_mindspeed_qwen3_next_tune_yaml_trains_on_two_ranks(tiny_next, tmp_path, commit):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.support.sft_assets import alpaca_rows

    table = json.loads((DATA / "launchers.json").read_text())
    entry = table[commit]["examples__fsdp2__qwen3_next__tune_qwen3_next_16k_fsdp2_A3.sh"]
    yaml_file = yaml_file_at(commit, entry["yaml"])
    assert yaml_file.parent.name == commit
    parquet = tmp_path / "alpaca.parquet"
    pq.write_table(pa.Table.from_pylist(alpaca_rows(32)), str(parquet))
    dataset = json.dumps({"file_name": str(parquet), "formatting": "alpaca"})  # for alpaca_full
    args = with_paths(yaml_file, entry["args"], (tiny_next, tiny_next, dataset, str(tmp_path / "output")))
    args += ["--parallel.fsdp_size", "2", *SCALED]
    command = _command(yaml_file, args)
    _three_steps(run_command(command, {}, timeout=900), command)
    run = json.loads((tmp_path / "output" / "iter_0000003" / "run_config.json").read_text())
    assert run["training"]["stage"] == "sft" and run["model"]["model_id"] == "qwen3_next"
    assert run["data"]["template"] == "qwen3" and run["model"]["init_model_with_meta_device"] is True


def test_mindspeed_ascendc_gdn_pack_cp2_yaml(tiny_next, assets, tmp_path):  # noqa: F811
    """One thing it asks is declined with one line and turned off: the AscendC GDN ops (`use_flash_gdn`) off an
    NPU. The rest of it (model_id qwen3_next from the HF directory with meta init, packed documents
    (reset_attention_mask) under Ulysses cp 2 over the Gated DeltaNet and attention layers — documents under cp:
    tests/parallel/test_packed_context_parallel.py —, recompute, the mg data manager with EOD appended) trains 3 steps."""
    table = json.loads((DATA / "launchers.json").read_text())
    entry = table["head"]["tests__pipeline__st__qwen3-next__qwen3_next_ascendc-GDN_pack_cp2.sh"]
    yaml_file = yaml_file_at("head", entry["yaml"])
    dataset = json.dumps({"file_name": assets["parquet"]})
    args = with_paths(yaml_file, entry["args"], (tiny_next, tiny_next, dataset, str(tmp_path / "output")))
    args += ["--parallel.fsdp_size", "1", *SCALED]
    command = _command(yaml_file, args)
    result = run_command(command, {}, timeout=900)
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr, failure_report(result, command)
    assert _error_lines(result) == [
        "optimization.use_flash_gdn: the AscendC Gated DeltaNet ops need an Ascend NPU (this run is on cpu) — set "
        "it to false (use_triton_gdn on CUDA)"], failure_report(result, command)

    command = _command(yaml_file, args + ["--optimization.use_flash_gdn", "False"])  # the one change
    _three_steps(run_command(command, {}, timeout=900), command)
    run = json.loads((tmp_path / "output" / "iter_0000003" / "run_config.json").read_text())
    assert run["parallel"]["cp_size"] == 2 and run["parallel"]["cp_type"] == "ulysses"
    assert run["data"]["data_manager_type"] == "mg" and run["data"]["append_eod"] is True
    assert run["data"]["reset_attention_mask"] is True


def _error_lines(result):
    """The distinct `error: ...` lines the ranks printed (each rank prints the same one)."""
    return sorted({line[len("error: "):] for line in result.stderr.splitlines() if line.startswith("error: ")})



def test_context_parallel_layout_rule_accepts_gdn_layers_of_the_model_id_only():
    """Validation lets cp run over Gated DeltaNet layers where the project makes them context parallel (model_id
    qwen3_next, parallel/context_parallel/linear_attention.py), and still declines them for transformers' own
    class, whose GDN layers have no CP."""
    from fsdp2_backend.config.rules.parallel import check_model_layout
    from fsdp2_backend.config.model_facts import ModelFacts
    from tests.support.configs import pt_config

    facts = ModelFacts(source="hf directory", model_type="qwen3_next", num_heads=4, num_kv_heads=2,
                       layer_types=("linear_attention", "full_attention"))
    found = {}
    for model_id in ("qwen3_next", None):
        config = pt_config(model={"model_id": model_id}, parallel={"cp_size": 2, "cp_type": "ulysses"},
                           data={"cutoff_len": 64})
        found[model_id] = []
        check_model_layout(config, facts, 2, found[model_id])
    assert found["qwen3_next"] == []
    assert found[None] == ["parallel.cp_size: layer types ['linear_attention'] of model_type qwen3_next are not "
                           "supported by context parallel — use cp_size 1"]
