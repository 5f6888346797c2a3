"""MindSpeed-LLM's YAMLs of the newer model ids (deepseek_v4, glm52, longcat_flash_ngram) as cases: the copied files
(`NEWER_IDS_DATA`, `NEWER_IDS_EXAMPLES`), the module-scoped `assets` fixture (a tiny saved model per id and a
parquet dataset) and a YAML's launch arguments with local paths (`newer_model_args`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launchers import REPO
from tests.support.tiny_models import save_tiny, train_bytelevel_tokenizer

NEWER_IDS_DATA = Path(REPO) / "tests" / "data" / "mindspeed_fsdp2" / "head_newer_ids"


NEWER_IDS_EXAMPLES = {"deepseek_v4": "examples__fsdp2__deepseek4__pretrain_deepseek4_flash_284b_4k_fsdp2_A3.yaml",
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
    for model_id in NEWER_IDS_EXAMPLES:
        path = root / model_id
        tokenizer = train_bytelevel_tokenizer(path, vocab_size=300)
        save_tiny(model_id, path, vocab_size=len(tokenizer))
        models[model_id] = str(path)
    return {"models": models, "dataset": json.dumps({"file_name": str(parquet)})}


def newer_model_args(assets, model_id, out):
    return ["--model.model_name_or_path", assets["models"][model_id], "--model.tokenizer_name_or_path",
            assets["models"][model_id], "--model.trust_remote_code", "false", "--data.dataset", assets["dataset"],
            "--training.output_dir", str(out), "--data.cutoff_len", "32", "--training.max_steps", "2",
            "--training.save_steps", "0", "--training.lr", "1e-3", "--training.warmup_ratio", "0",
            "--training.per_device_train_batch_size", "2", "--training.dataloader_num_workers", "0",
            "--parallel.ep_size", "1", "--parallel.ep_fsdp_size", "1"]
