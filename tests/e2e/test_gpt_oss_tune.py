"""MindSpeed-LLM's gpt_oss tune YAMLs (stage sft, template gpt), their launchers' arguments with the paths replaced
and the layout scaled to 2 CPU ranks (EP 2 where the launcher uses EP; Ulysses cp 2 where the YAML asks cp),
load a tiny GPT-OSS and train 3 steps with finite, printed losses."""
import json
import math
import os

import pytest

from tests.support.launchers import REPO, torchrun_command
from tests.support.tiny_models import train_bytelevel_tokenizer
from tests.support.launchers import failure_report, run_command, train_lines

HEAD = os.path.join(REPO, "tests", "data", "mindspeed_fsdp2", "head")
# (YAML, the launcher's --optimization switches, the layout scaled to 2 ranks)
CASES = {
    "tests__st__shell_scripts__tune_gpt_oss_20b_a3b_4K_fsdp2.yaml": ([], ["--parallel.ep_size", "2"]),
    "examples__fsdp2__gpt_oss__tune_gpt_oss_20b_varlen_fsdp2_A3.yaml": (
        ["--optimization.use_fused_rmsnorm", "True", "--optimization.moe_grouped_gemm", "True",
         "--optimization.use_fused_rotary_pos_emb", "True", "--optimization.use_flash_attn", "True"],
        ["--parallel.ep_size", "2"]),
    "examples__fsdp2__gpt_oss__tune_gpt_oss_20b_128k_fsdp2_A3.yaml": (
        ["--optimization.use_fused_rmsnorm", "True", "--optimization.use_fused_rotary_pos_emb", "True",
         "--optimization.use_flash_attn", "True"],
        ["--parallel.ep_size", "1", "--parallel.cp_size", "2"]),
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.support.sft_assets import alpaca_rows

    root = tmp_path_factory.mktemp("gpt_oss_tune")
    parquet = root / "train-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(alpaca_rows(32)), str(parquet))
    model = root / "tiny-gpt-oss"
    tokenizer = train_bytelevel_tokenizer(model, vocab_size=300)
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                          layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(str(model))
    return {"model": str(model), "dataset": json.dumps({"file_name": str(parquet), "formatting": "alpaca"})}


@pytest.mark.parametrize("name", sorted(CASES))
def test_tune_yaml_trains_three_steps_on_two_ranks(assets, tmp_path, name):
    from fsdp2_backend.training.logging import parse_train_line

    switches, layout = CASES[name]
    args = ["--model.model_name_or_path", assets["model"], "--model.tokenizer_name_or_path", assets["model"],
            "--data.dataset", assets["dataset"], "--parallel.fsdp_size", "2", "--parallel.ep_fsdp_size", "1",
            *layout, *switches, "--training.per_device_train_batch_size", "1",
            "--training.gradient_accumulation_steps", "1", "--training.output_dir", str(tmp_path / "output"),
            "--training.max_steps", "3", "--data.cutoff_len", "64", "--training.save_steps", "0",
            "--training.dataloader_num_workers", "0", "--training.lr", "1e-3"]
    command = torchrun_command(2, os.path.join(REPO, "pretrain_fsdp2.py"), os.path.join(HEAD, name), *args)
    result = run_command(command, {}, timeout=600)
    assert result.returncode == 0, failure_report(result, command)
    lines = train_lines(result.stdout + result.stderr, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    assert all(math.isfinite(line["losses"]["lm loss"]) for line in lines)
