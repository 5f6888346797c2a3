"""MindSpeed-LLM's gpt_oss pretraining YAML (its launcher's arguments, paths replaced, sizes scaled to 2 CPU ranks)
trains a tiny GPT-OSS with the gpt_oss model id: expert parallel 2 on 2 ranks prints the lm loss of one rank
(no EP) at every step, within 1e-4; the export loads in transformers. The copy MindSpeed-LLM v26.1.0 ships
(f88dd26d's) gives the same losses."""
import json
import os

import pytest
import torch

from tests.support.launchers import REPO, torchrun_command
from tests.support.tiny_models import text_parquet_and_tokenizer
from tests.support.launchers import LOG_LINE_START, failure_report, run_command

YAML = os.path.join(REPO, "tests", "data", "mindspeed_fsdp2", "head",
                    "examples__fsdp2__gpt_oss__pretrain_gpt_oss_20b_4k_fsdp2_A3.yaml")
# f88dd26d's copy, which MindSpeed-LLM v26.1.0 ships unchanged: master's YAML with its launcher's switches inside
RELEASE_YAML = YAML.replace(os.sep + "head" + os.sep, os.sep + "f88dd26d" + os.sep)
# head's launcher: --optimization.* switches it gives (fused rmsnorm / rotary, grouped GEMM)
LAUNCHER_SWITCHES = ["--optimization.use_fused_rmsnorm", "True", "--optimization.moe_grouped_gemm", "True",
                     "--optimization.use_fused_rotary_pos_emb", "True"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss_assets")
    parquet, model, tokenizer = text_parquet_and_tokenizer(root, "tiny-gpt-oss")
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = GptOssForCausalLM(config)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.sinks.normal_(0, 0.5)
    hf.save_pretrained(str(model))
    return {"model": str(model), "dataset": json.dumps({"file_name": str(parquet)})}


def _train(assets, out, ranks, ep, yaml_file=YAML):
    from fsdp2_backend.training.logging import parse_train_line

    args = ["--model.model_name_or_path", assets["model"], "--data.dataset", assets["dataset"],
            "--parallel.fsdp_size", str(ranks), "--parallel.ep_size", str(ep), "--parallel.ep_fsdp_size", "1",
            "--training.per_device_train_batch_size", "1", "--training.gradient_accumulation_steps", str(3 - ranks),
            "--training.output_dir", str(out), *LAUNCHER_SWITCHES, "--training.max_steps", "4",
            "--data.cutoff_len", "64", "--training.save_steps", "4", "--training.lr", "1e-3"]
    command = torchrun_command(ranks, os.path.join(REPO, "pretrain_fsdp2.py"), yaml_file, *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    lines = [parsed for line in log.splitlines() for start in LOG_LINE_START.finditer(line)
             if (parsed := parse_train_line(line[start.start():]))]
    return {line["iteration"]: line["losses"]["lm loss"] for line in lines}, log


@pytest.fixture(scope="module")
def one_rank(assets, tmp_path_factory):
    one, log = _train(assets, tmp_path_factory.mktemp("gpt_oss_one"), ranks=1, ep=1)
    assert sorted(one) == [1, 2, 3, 4], log[-3000:]
    return one


def test_mindspeed_yaml_ep2_equals_one_rank_and_exports(assets, one_rank, tmp_path):
    one = one_rank
    ep2, log = _train(assets, tmp_path / "ep2", ranks=2, ep=2)
    assert sorted(ep2) == [1, 2, 3, 4], log[-3000:]
    for it in one:
        assert ep2[it] == pytest.approx(one[it], rel=1e-4), (it, one[it], ep2[it])
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ep2" / "hf"), attn_implementation="eager")
    assert type(exported).__name__ == "GptOssForCausalLM"


def test_release_yaml_ep2_prints_the_one_rank_losses(assets, one_rank, tmp_path):
    """The gpt_oss example as MindSpeed-LLM v26.1.0 (and f88dd26d) ship it — paths, sizes and switches inside — its
    paths and sizes overridden: under EP 2 it prints master's YAML's one-rank losses."""
    ep2, log = _train(assets, tmp_path / "release", ranks=2, ep=2, yaml_file=RELEASE_YAML)
    assert sorted(ep2) == [1, 2, 3, 4], log[-3000:]
    for it in one_rank:
        assert ep2[it] == pytest.approx(one_rank[it], rel=1e-4), (it, one_rank[it], ep2[it])
