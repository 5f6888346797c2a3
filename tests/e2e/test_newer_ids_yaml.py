"""MindSpeed-LLM's FSDP2 YAMLs of the three model ids it added after the seed (tests/data/mindspeed_fsdp2/
head_newer_ids/, commit c77308a1: deepseek_v4, glm52, longcat_flash_ngram), with only their paths replaced (a tiny
model of each saved by transformers, a tiny tokenizer, a raw-text parquet file, output_dir → tmp) and sizes scaled
down by overrides: each example YAML trains on 2 gloo ranks (its ChunkMBS, fused_adamw, router_aux_loss_coef,
custom-FSDP and DSA fields included), with the losses of a one-rank run of the same two micro-batches; glm52 trains
with expert parallel 2 too. Every YAML of the set validates at world size 2; DeepSeek-V4's CP 2 kvallgather one
trains on 2 ranks (cp 2: parallel/context_parallel/dsa_deepseek_v4.py) with the lm and indexer losses of its one-rank
run at cp_size 1. MindSpeed-LLM v26.1.0's glm52 and LongCat YAMLs (tests/data/mindspeed_fsdp2/v26.1.0) validate too,
and its glm52 pipeline YAML (optimization.indexer_loss_coeff 0.1) and LongCat YAML (model_id longcat_flash, experts
merged offline) train on 2 ranks."""
import os
from pathlib import Path

import pytest

from tests.support.launchers import LOG_LINE_START, failure_report, run_command
from tests.support.launchers import REPO, torchrun_command
from tests.support.newer_ids_yaml import NEWER_IDS_DATA, NEWER_IDS_EXAMPLES, newer_model_args
from tests.support.newer_ids_yaml import assets  # noqa: F401  (pytest fixture)

DEEPSEEK_V4_CP2 = "tests__st__shell_scripts__pretrain_deepseek4_flash_1k_fsdp2_cp2.yaml"
# MindSpeed-LLM v26.1.0 (the release): its copies of these ids' YAMLs (model_id longcat_flash, the LongCat weights
# merged offline, optimization.indexer_loss_coeff 0.1: config/mindspeed_release_rules.py)
RELEASE = NEWER_IDS_DATA.parent / "v26.1.0"
RELEASE_YAMLS = {
    "glm52": "tests__pipeline__st__glm52__pretrain_glm52_38b_4k_fsdp2_A3.yaml",
    "longcat_flash_ngram": "examples__fsdp2__longcat_flash_lite__pretrain_longcat_flash_lite_4k_fsdp2_A3.yaml"}


def _losses(log, name="lm loss"):
    """{iteration: the logged loss `name`} of a training log."""
    from fsdp2_backend.training.logging import parse_train_line

    lines = [parsed for line in log.splitlines() for start in LOG_LINE_START.finditer(line)
             if (parsed := parse_train_line(line[start.start():]))]
    return {line["iteration"]: line["losses"][name] for line in lines}


def _train(assets, model_id, out, ranks, *extra, yaml_name=None, folder=NEWER_IDS_DATA):
    args = newer_model_args(assets, model_id, out) + ["--parallel.fsdp_size", str(ranks),
                                                 "--training.gradient_accumulation_steps", str(3 - ranks), *extra]
    command = torchrun_command(ranks, os.path.join(REPO, "pretrain_fsdp2.py"),
                               str(folder / (yaml_name or NEWER_IDS_EXAMPLES[model_id])), *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    return _losses(log), log


@pytest.fixture(scope="module")
def one_rank(assets, tmp_path_factory):
    """The one-rank losses of each example YAML (run once, shared by the tests comparing to them)."""
    runs = {}

    def losses(model_id):
        if model_id not in runs:
            runs[model_id] = _train(assets, model_id, tmp_path_factory.mktemp(f"one_{model_id}"), 1)[0]
        return runs[model_id]
    return losses


@pytest.mark.parametrize("model_id", sorted(NEWER_IDS_EXAMPLES))
def test_example_yaml_trains_on_two_ranks_as_on_one(assets, one_rank, model_id, tmp_path):
    two, log = _train(assets, model_id, tmp_path / "two", 2)
    assert sorted(two) == [1, 2], log[-3000:]
    if model_id != "longcat_flash_ngram":  # the DSA indexers are trained (training.indexer_loss_coeff 1.0, MindSpeed's)
        assert "indexer loss:" in log, log[-3000:]
    one = one_rank(model_id)
    for it in (1, 2):
        assert two[it] == pytest.approx(one[it], rel=2e-4), (it, one, two)


def _model_id(path):
    """The YAML's model id, as this project names it (the release's longcat_flash: longcat_flash_ngram)."""
    import yaml

    from fsdp2_backend.config.schema import MODEL_ID_ALIASES

    model_id = yaml.safe_load(path.read_text())["model"]["model_id"]
    return MODEL_ID_ALIASES.get(model_id, (model_id,))[0]


VALIDATED = [(NEWER_IDS_DATA, p.name) for p in sorted(NEWER_IDS_DATA.glob("*.yaml"))] + \
    [(RELEASE, p.name) for p in sorted(RELEASE.glob("*.yaml")) if "glm52" in p.name or "longcat" in p.name]


@pytest.mark.parametrize("folder,yaml_name", VALIDATED, ids=[f"{f.name}:{n}" for f, n in VALIDATED])
def test_every_yaml_validates_at_world_size_two(assets, folder, yaml_name, tmp_path):
    from fsdp2_backend.launch import parse_command_line

    model_id = _model_id(folder / yaml_name)
    argv = [str(folder / yaml_name), *newer_model_args(assets, model_id, tmp_path), "--parallel.fsdp_size", "2"]
    config, lines = parse_command_line(argv, 2)
    assert config.model.model_id == model_id
    if folder == RELEASE and "longcat" in yaml_name:
        assert [line for line in lines if line.startswith("notice: model.model_id: longcat_flash is MindSpeed-LLM "
                                                          "v26.1.0's name of longcat_flash_ngram")], lines
    if folder == RELEASE and "pipeline__st__glm52" in yaml_name:  # the release's spelling, applied
        assert config.training.indexer_loss_coeff == 0.1
        assert [line for line in lines if line.startswith("notice: optimization.indexer_loss_coeff: 0.1")], lines
    assert config.parallel.cp_type in ("ulysses", "ring")
    if yaml_name == DEEPSEEK_V4_CP2:  # kvallgather (as ring's layout), MindSpeed's way: the keys all-gathered
        assert (config.parallel.cp_size, config.parallel.cp_type) == (2, "ring")
        assert any("kvallgather for model_id deepseek_v4" in line for line in lines), lines
    if "deepseek4_flash_284b" in yaml_name:  # the example's MindSpeed fields, each honoured or said
        p, t = config.parallel, config.training
        assert (p.enable_chunk_batch, p.chunk_mbs, t.optimizer, t.router_aux_loss_coef, t.deterministic) == \
            (True, 1, "fused_adamw", 0.001, False)
        assert any("fsdp_implementation: custom" in line for line in lines), lines
        assert any("hook_modules: no effect" in line for line in lines), lines
        assert any("ep_dispatcher: mc2 (an Ascend MC2 kernel) has no effect with ep_size 1" in line
                   for line in lines), lines


def test_glm52_expert_parallel_two_equals_one_rank(assets, one_rank, tmp_path):
    ep2, log = _train(assets, "glm52", tmp_path / "ep2", 2, "--parallel.ep_size", "2", "--parallel.ep_fsdp_size",
                      "1", "--parallel.ep_dispatcher", "eager")
    one = one_rank("glm52")
    for it in (1, 2):
        assert ep2[it] == pytest.approx(one[it], rel=2e-4), (it, one, ep2)


def test_deepseek_v4_cp2_yaml_trains_with_the_one_rank_losses(assets, tmp_path):
    """MindSpeed's DeepSeek-V4 kvallgather YAML (cp 2; recompute, fix_router, the indexer KL loss at MindSpeed's
    coefficient 1), with the tiny model's MTP layer built (the YAML's mtp.layers modules; MTP initialises on a real
    device), on 2 ranks: one sequence's halves per rank (data parallel 1, 2 micro-batches of 2 sequences). Its lm
    and MTP losses are those of the same YAML at cp_size 1 on one rank, and so is step 1's indexer loss (the same
    weights). Step 2's indexer loss differs by ~1% and is only checked finite: the step-1 gradients are summed in
    another order (per cp rank), and this run amplifies such rounding — one rank with the same 4 sequences as 4
    micro-batches of 1 instead of 2 of 2 moves step 2's indexer loss by 1.1% and its lm loss by 8e-6 too, as cp 2
    does (1.2%, 6e-6). Under cp 2 without the trainer, this tiny model's step-1 gradients are one rank's within
    5e-6 relative, and 3 AdamW steps' lm and indexer losses within 1e-6."""
    mtp = ("--model.mtp_num_layers", "1", "--model.init_model_with_meta_device", "false")
    cp2, log = _train(assets, "deepseek_v4", tmp_path / "cp2", 2, "--training.gradient_accumulation_steps", "2",
                      *mtp, yaml_name=DEEPSEEK_V4_CP2)
    one, one_log = _train(assets, "deepseek_v4", tmp_path / "one", 1, "--parallel.cp_size", "1", *mtp,
                          yaml_name=DEEPSEEK_V4_CP2)
    assert sorted(cp2) == sorted(one) == [1, 2], log[-3000:]
    mtp_loss, one_mtp = _losses(log, "mtp_1 loss"), _losses(one_log, "mtp_1 loss")
    indexer, one_indexer = _losses(log, "indexer loss"), _losses(one_log, "indexer loss")
    for it in (1, 2):
        assert cp2[it] == pytest.approx(one[it], rel=2e-4), (it, one, cp2)
        assert mtp_loss[it] == pytest.approx(one_mtp[it], rel=2e-4), (it, one_mtp, mtp_loss)
    assert indexer[1] == pytest.approx(one_indexer[1], rel=2e-5), (one_indexer, indexer)
    assert 0 < indexer[2] < 10, indexer


@pytest.mark.parametrize("model_id", sorted(RELEASE_YAMLS))
def test_release_yaml_trains_on_two_ranks(assets, model_id, tmp_path):
    """The release's glm52 pipeline YAML (indexer KL loss weighted 0.1, its spelling: its step-1 indexer loss is a
    tenth of master's copy's, weighted 1.0) and its LongCat YAML (model_id longcat_flash) on weights merged offline as
    MindSpeed's moe_hf_param_merge_experts.sh does (tests/models/test_merged_experts_loading.py's writer), each said
    once in the log, train on 2 ranks."""
    import math

    extra = ()
    if model_id == "longcat_flash_ngram":
        from tests.support.mindspeed_yaml import merge_like_mindspeed

        merged = tmp_path / "LongCat-Flash-Lite-mergeExperts"
        merge_like_mindspeed(Path(assets["models"][model_id]), merged, "3d")
        extra = ("--model.model_name_or_path", str(merged), "--model.tokenizer_name_or_path", str(merged))
    losses, log = _train(assets, model_id, tmp_path / "two", 2, *extra, yaml_name=RELEASE_YAMLS[model_id],
                         folder=RELEASE)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), log[-3000:]
    said = ("optimization.indexer_loss_coeff: 0.1 weighs the DSA indexer's KL loss" if model_id == "glm52" else
            "model.model_id: longcat_flash is MindSpeed-LLM v26.1.0's name of longcat_flash_ngram")
    assert log.count(said) == 1, log[-3000:]
    if model_id == "glm52":
        # master's copy of the pipeline YAML, given the release's switches but not its indexer_loss_coeff spelling:
        # the weight is master's 1.0. The same step-1 forward, so the logged indexer loss (coefficient included)
        # is ten times the release's 0.1-weighted one.
        switches = [arg for name in ("use_fused_rmsnorm", "moe_grouped_gemm", "use_fused_rotary_pos_emb",
                                     "use_sparse_flash_attn", "use_fused_lightning_indexer",
                                     "use_fused_lightning_indexer_loss") for arg in (f"--optimization.{name}", "true")]
        master_yaml = RELEASE_YAMLS[model_id]  # the same file name in head_newer_ids/
        master, master_log = _train(assets, model_id, tmp_path / "master", 2, *switches, yaml_name=master_yaml)
        assert "optimization.indexer_loss_coeff" not in master_log
        assert master[1] == pytest.approx(losses[1], rel=1e-6), (master, losses)
        indexer, master_indexer = _losses(log, "indexer loss"), _losses(master_log, "indexer loss")
        assert indexer[1] == pytest.approx(0.1 * master_indexer[1], rel=1e-5), (indexer, master_indexer)
