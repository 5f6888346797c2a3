"""Step-3.5-Flash's MindSpeed YAML as a case: the copied example (`STEP35_EXAMPLES`), the release's config.json values
(`STEP35_FLASH`) and the module-scoped `assets` fixture (a tiny Step-3.5 checkpoint in its on-disk layout)."""
from __future__ import annotations

import json
import os

import pytest

from tests.support.launchers import REPO
from tests.support.step35_reference import step35_config, step35_config_dict, step35_reference, write_step35_checkpoint
from tests.support.tiny_models import text_parquet_and_tokenizer

DATA = os.path.join(REPO, "tests", "data", "mindspeed_fsdp2")


STEP35_EXAMPLES = os.path.join(DATA, "head", "examples__fsdp2__step35__pretrain_step_3p5_flash_196b_4K_fsdp2_A3.yaml")


# Step-3.5-Flash's published sizes that the layout checks read (heads, groups, experts, layers, vocabulary)
STEP35_FLASH = dict(
    vocab_size=128896, hidden_size=4096, num_hidden_layers=45, num_attention_heads=64, num_attention_groups=8,
    head_dim=128, moe_num_experts=288, moe_top_k=8, moe_intermediate_size=1280, share_expert_dim=1280,
    intermediate_size=11264, moe_layers_enum=",".join(map(str, range(3, 45))), num_nextn_predict_layers=3,
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"] * 12,
    attention_other_setting={"attention_type": "sliding_attention", "num_attention_heads": 96,
                             "num_attention_groups": 8, "head_dim": 128, "true_head_dim": 128})


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("step35_assets")
    parquet, model, tokenizer = text_parquet_and_tokenizer(root, "tiny-step35")
    vocab = len(tokenizer)
    text, head = step35_reference(step35_config(vocab_size=vocab), large_mlp=False)
    written = write_step35_checkpoint(model, text, head, step35_config_dict(vocab_size=vocab))
    return {"model": str(model), "dataset": json.dumps({"file_name": str(parquet)}), "keys": set(written)}
