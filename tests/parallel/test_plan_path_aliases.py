"""MindSpeed-LLM f88dd26d's MiniMax-M2.7 YAML names the experts as the HF checkpoint does
(`model.layers.{*}.block_sparse_moe.experts`); transformers 5 (and this project's MiniMax model) call the sparse
block `mlp`. The plan fields accept both naming eras: the old name picks the same modules as the new one."""
from pathlib import Path

import pytest
import torch
import yaml

from fsdp2_backend.parallel.expert_parallel import expert_modules
from fsdp2_backend.parallel.plans import match_modules, require_matches, unmatched_patterns
from fsdp2_backend.usage_errors import UsageError

DATA = Path(__file__).resolve().parents[1] / "data" / "mindspeed_fsdp2"


def _tiny_minimax():
    from transformers import MiniMaxM2Config

    from fsdp2_backend.models.minimax_m27.modeling import build_minimax_m2

    config = MiniMaxM2Config(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
                             num_experts_per_tok=2, rotary_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    return build_minimax_m2(config)


def test_f88dd26d_minimax_yaml_expert_paths_pick_the_experts():
    old = yaml.safe_load((DATA / "f88dd26d" / "examples__fsdp2__minimax_m27__pretrain_minimax_m2p7_229b_4K_fsdp2_A3"
                                            ".yaml").read_text())["parallel"]
    assert old["ep_modules"] == ["model.layers.{*}.block_sparse_moe.experts"]  # the naming this test is about
    model = _tiny_minimax()
    names = [name for name, _ in expert_modules(model, old["ep_modules"], "parallel.ep_modules")]
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert [n for n, _ in require_matches(model, old["ep_fsdp_modules"], "parallel.ep_fsdp_modules")] == names
    # the new naming picks the same modules; a misspelt component still matches nothing
    assert [n for n, _ in match_modules(model, ["model.layers.{*}.mlp.experts"])] == names
    assert unmatched_patterns(model, ["model.layers.{*}.block_sparse.experts"]) == \
        ["model.layers.{*}.block_sparse.experts"]


def test_models_without_aliases_do_not_rename():
    from transformers import Qwen3ForCausalLM

    from tests.support.tiny_models import tiny_qwen3_config

    model = Qwen3ForCausalLM(tiny_qwen3_config(num_hidden_layers=1))
    with pytest.raises(UsageError, match="block_sparse_moe"):
        require_matches(model, ["model.layers.{*}.block_sparse_moe"], "parallel.ep_modules")
