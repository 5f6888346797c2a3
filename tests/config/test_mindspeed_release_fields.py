"""MindSpeed-LLM's release v26.1.0 against its master (config/mindspeed_release_rules.py): the fields the two
versions read differently (found by diffing their `mindspeed_llm/fsdp2/utils/arguments.py` and YAMLs), each resolved
and said once — with non-default values and the release's own YAMLs (tests/data/mindspeed_fsdp2/v26.1.0)."""
from pathlib import Path

import pytest
import yaml

from fsdp2_backend.config.loading import build_config, load_yaml
from fsdp2_backend.config.mindspeed_release_rules import MASTER_ONLY, release_readings
from fsdp2_backend.config.validation import validate_with_notices
from fsdp2_backend.usage_errors import UsageError
from tests.support.tiny_models import tiny_model_dir

DATA = Path(__file__).resolve().parents[1] / "data" / "mindspeed_fsdp2"
RELEASE_GLM = DATA / "v26.1.0" / "tests__pipeline__st__glm52__pretrain_glm52_38b_4k_fsdp2_A3.yaml"
RELEASE_LONGCAT = DATA / "v26.1.0" / "examples__fsdp2__longcat_flash_lite__pretrain_longcat_flash_lite_4k_fsdp2_A3.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny"), seed=0)


def _validate(model_dir, tmp_path, **groups):
    base = {"model": {"model_name_or_path": model_dir}, "data": {"data_manager_type": "mg", "mock_data": True,
                                                                  "cutoff_len": 32},
            "training": {"stage": "pt", "output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": 4}}
    for group, values in groups.items():
        base.setdefault(group, {}).update(values)
    return validate_with_notices(build_config([("test", base)]), 2)


def _said(notices, start):
    return [n for n in notices if n.startswith(start)]


def test_release_yamls_spell_what_the_rules_resolve():
    """The two spellings the release's own YAMLs use (the fixture of the rules below is the real file)."""
    glm = yaml.safe_load(RELEASE_GLM.read_text())
    assert glm["optimization"]["indexer_loss_coeff"] == 0.1 and "indexer_loss_coeff" not in glm["training"]
    assert yaml.safe_load(RELEASE_LONGCAT.read_text())["model"]["model_id"] == "longcat_flash"


def test_release_indexer_loss_coeff_is_applied_and_said_once(model_dir, tmp_path):
    config, notices = _validate(model_dir, tmp_path, optimization={"indexer_loss_coeff": 0.1})
    assert config.training.indexer_loss_coeff == 0.1
    said = _said(notices, "optimization.indexer_loss_coeff: 0.1 weighs the DSA indexer's KL loss")
    assert len(said) == 1 and "MindSpeed-LLM master ignores it" in said[0] and "this run applies it" in said[0], notices
    again, notices_again = validate_with_notices(config, 2)  # the resolved config validates silently
    assert again.training.indexer_loss_coeff == 0.1 and not _said(notices_again, "optimization.indexer_loss_coeff")


def test_master_spelling_and_the_default(model_dir, tmp_path):
    config, notices = _validate(model_dir, tmp_path, training={"indexer_loss_coeff": 0.25})
    assert config.training.indexer_loss_coeff == 0.25 and not _said(notices, "optimization.indexer_loss_coeff")
    assert _validate(model_dir, tmp_path)[0].training.indexer_loss_coeff == 1.0  # MindSpeed's default, both versions
    # both spellings with one value: accepted
    config, _ = _validate(model_dir, tmp_path, training={"indexer_loss_coeff": 0.3},
                          optimization={"indexer_loss_coeff": 0.3})
    assert config.training.indexer_loss_coeff == 0.3


def test_both_spellings_that_differ_are_refused(model_dir, tmp_path):
    with pytest.raises(UsageError) as err:
        _validate(model_dir, tmp_path, training={"indexer_loss_coeff": 1.0}, optimization={"indexer_loss_coeff": 0.1})
    text = str(err.value)
    assert text.startswith("optimization.indexer_loss_coeff: 0.1 (MindSpeed-LLM v26.1.0's spelling) and "
                           "training.indexer_loss_coeff 1.0"), text
    assert text.count("indexer_loss_coeff: 0.1") == 1


def test_release_model_id_is_longcat_flash_ngram_said_once():
    config, errors, notices = release_readings(build_config([("t", {"model": {"model_id": "longcat_flash"}})]))
    assert config.model.model_id == "longcat_flash_ngram" and not errors
    assert notices == ["model.model_id: longcat_flash is MindSpeed-LLM v26.1.0's name of longcat_flash_ngram "
                       "(MindSpeed-LLM master's) — this run builds longcat_flash_ngram"]
    from fsdp2_backend.models.registry import model_spec

    assert model_spec("longcat_flash") is model_spec("longcat_flash_ngram")


def test_master_only_fields_and_values_are_read_as_master_reads_them(model_dir, tmp_path):
    """Each field master's argument classes have and the release's lack, set to a non-default value, and the
    values the release's choices refuse: named in one line."""
    groups = {"parallel": {"hook_modules": ["model.layers.{*}", "lm_head"], "fsdp_implementation": "custom",
                           "enable_chunk_batch": True, "chunk_mbs": 2, "chunk_mbs_batch_dim": 1,
                           "chunk_mbs_modules": ["model.layers.{*}", "lm_head"], "chunk_mbs_arg_indexs": [0, 1],
                           "chunk_mbs_kwarg_names": ["position_ids"], "cp_size": 2, "cp_type": "kvallgather"},
              "training": {"deterministic": False, "indexer_loss_coeff": 0.5, "router_aux_loss_coef": 0.002,
                           "mtp_loss_scaling_factor": 0.2, "optimizer": "fused_adamw"},
              "optimization": {"use_ascend_mhc": True, "use_triton_swiglu_limit": True},
              "model": {"model_id": "deepseek_v4"}}
    config = build_config([("t", groups)])
    _, errors, notices = release_readings(config)
    assert not errors
    lines = [n for n in notices if "read as MindSpeed-LLM master reads them" in n]
    assert len(lines) == 1, notices
    for group, name in MASTER_ONLY:
        assert f"{group}.{name}" in lines[0], (group, name, lines[0])
    for value in ("model.model_id: deepseek_v4", "parallel.cp_type: kvallgather", "training.optimizer: fused_adamw"):
        assert value in lines[0], (value, lines[0])
    assert len(MASTER_ONLY) == 14
    # a release YAML sets none of them: nothing said
    _, _, release_notices = release_readings(build_config([("yaml", load_yaml(str(RELEASE_GLM)))]))
    assert not [n for n in release_notices if "read as MindSpeed-LLM master reads them" in n], release_notices


def test_a_megatron_line_is_told_nothing_about_mindspeed_versions(tmp_path):
    """A Megatron launch line sets training.deterministic (Megatron's --deterministic-mode default, off) and
    parallel.cp_size: no MindSpeed version read them, so nothing is said of one; the same field from a YAML is."""
    import subprocess
    import sys

    from tests.support.launchers import REPO

    line = [sys.executable, f"{REPO}/pretrain_fsdp2.py", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-4",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--mock-data", "--dry-run"]
    result = subprocess.run(line, capture_output=True, text=True, cwd=REPO, env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "MindSpeed-LLM" not in result.stdout + result.stderr
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("training:\n  deterministic: false\n")
    result = subprocess.run(line[:2] + [str(yaml_file)] + line[2:], capture_output=True, text=True, cwd=REPO,
                            env={"HF_HUB_OFFLINE": "1", "PATH": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    said = [n for n in (result.stdout + result.stderr).splitlines() if "read as MindSpeed-LLM master reads" in n]
    assert len(said) == 1 and "training.deterministic" in said[0], said
