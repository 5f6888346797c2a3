"""MindSpeed-LLM's FSDP2 YAMLs of the three model ids it added after the seed (tests/data/mindspeed_fsdp2/
head_newer_ids/, commit c77308a1: deepseek_v4, glm52, longcat_flash_ngram), with only their paths replaced (a tiny
model of each saved by transformers, a tiny tokenizer, a raw-text parquet file, output_dir → tmp) and sizes scaled
down by overrides: each example YAML trains on 2 gloo ranks (its ChunkMBS, fused_adamw, router_aux_loss_coef,
custom-FSDP and DSA fields included), with the losses of a one-rank run of the same two micro-batches; glm52 trains
with expert parallel 2 too. Every YAML of the set dry-runs at world size 2 (the CP 2 kvallgather one too)."""
import json
import os
import sys
from pathlib import Path

import pytest

from tests.e2e.test_mindspeed_yaml import LOG_LINE_START, _failure, _run
from tests.helpers import REPO, free_port, train_bytelevel_tokenizer
from tests.models.test_newer_model_ids import save_tiny, tiny_config

DATA = Path(REPO) / "tests" / "data" / "mindspeed_fsdp2" / "head_newer_ids"
EXAMPLES = {"deepseek_v4": "examples__fsdp2__deepseek4__pretrain_deepseek4_flash_284b_4k_fsdp2_A3.yaml",
            "glm52": "examples__fsdp2__glm52__glm52_744b_4k_fsdp2_A3.yaml",
            "longcat_flash_ngram": "examples__fsdp2__longcat_flash_lite__pretrain_longcat_flash_lite_4k_fsdp2_A3.yaml"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fsdp2_backend.cli.demo_assets import stdlib_texts

    root = tmp_path_factory.mktemp("newer_ids")
    parquet = root / "train.parquet"
    pq.write_table(pa.table({"text": stdlib_texts(max_files=16, max_chars=1500)}), str(parquet))
    models = {}
    for model_id in EXAMPLES:
        path = root / model_id
        tokenizer = train_bytelevel_tokenizer(path, vocab_size=300)
        config = tiny_config(model_id)
        config.vocab_size = len(tokenizer)
        import tests.models.test_newer_model_ids as tiny
        tiny.VOCAB, saved = len(tokenizer), tiny.VOCAB
        try:
            save_tiny(model_id, path)
        finally:
            tiny.VOCAB = saved
        models[model_id] = str(path)
    return {"models": models, "dataset": json.dumps({"file_name": str(parquet)})}


def _model_args(assets, model_id, out):
    return ["--model.model_name_or_path", assets["models"][model_id], "--model.tokenizer_name_or_path",
            assets["models"][model_id], "--model.trust_remote_code", "false", "--data.dataset", assets["dataset"],
            "--training.output_dir", str(out), "--data.cutoff_len", "32", "--training.max_steps", "2",
            "--training.save_steps", "0", "--training.lr", "1e-3", "--training.warmup_ratio", "0",
            "--training.per_device_train_batch_size", "2", "--training.dataloader_num_workers", "0",
            "--parallel.ep_size", "1", "--parallel.ep_fsdp_size", "1",
            "--parallel.ep_dispatcher", "eager"]  # the DeepSeek-V4 example's mc2 is an NPU kernel: off


def _train(assets, model_id, out, ranks, *extra):
    from fsdp2_backend.training.logging import parse_train_line

    args = _model_args(assets, model_id, out) + ["--parallel.fsdp_size", str(ranks),
                                                 "--training.gradient_accumulation_steps", str(3 - ranks), *extra]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), os.path.join(REPO, "pretrain_fsdp2.py"), str(DATA / EXAMPLES[model_id]), *args]
    result = _run(command, {}, timeout=600)
    assert result.returncode == 0, _failure(result, command)
    log = result.stdout + result.stderr
    lines = [parsed for line in log.splitlines() for start in LOG_LINE_START.finditer(line)
             if (parsed := parse_train_line(line[start.start():]))]
    return {line["iteration"]: line["losses"]["lm loss"] for line in lines}, log


@pytest.mark.parametrize("model_id", sorted(EXAMPLES))
def test_example_yaml_trains_on_two_ranks_as_on_one(assets, model_id, tmp_path):
    two, log = _train(assets, model_id, tmp_path / "two", 2)
    assert sorted(two) == [1, 2], log[-3000:]
    one, _ = _train(assets, model_id, tmp_path / "one", 1)
    for it in (1, 2):
        assert two[it] == pytest.approx(one[it], rel=2e-4), (it, one, two)
    assert "NPU" not in log or "no effect" in log
