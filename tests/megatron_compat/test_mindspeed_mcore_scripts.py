"""MindSpeed-LLM's own Megatron-side pretrain scripts for the seed's model families translate (`--dry-run`'s
parse → translate → validate, in-process), or are declined only by a layout this engine cannot run, named.

tests/data/mindspeed_llm_mcore_scripts.json holds each script's launch line (Ascend/MindSpeed-LLM at the commit it
names: `examples/mcore/{qwen3,qwen3_moe,qwen3_next,qwen3_coder_next,minimax27}/pretrain_*.sh`, run through bash
with torchrun stubbed). MindSpeed-LLM has no Megatron-side script for gpt_oss or step35 (only fsdp2 YAML ones).
Every value checked below is read off the script's own argv, not produced by the translation.
"""
import json
from pathlib import Path

import pytest

from fsdp2_backend.launch import parse_command_line
from fsdp2_backend.usage_errors import UsageError

DATA = json.loads((Path(__file__).resolve().parents[1] / "data" / "mindspeed_llm_mcore_scripts.json").read_text())
LINES = DATA["lines"]

# Scripts whose layout the engine declines at validation, and the one reason that may stop them.
LAYOUT_DECLINES = {}

# flag → (config group, field, type): the script's value must arrive there unchanged.
CHECKED = {"--tensor-model-parallel-size": ("parallel", "tp_size", int),
           "--expert-model-parallel-size": ("parallel", "ep_size", int),
           "--seq-length": ("data", "cutoff_len", int), "--lr": ("training", "lr", float),
           "--train-iters": ("training", "max_steps", int),
           "--global-batch-size": ("training", "global_batch_size", int),
           "--micro-batch-size": ("training", "per_device_train_batch_size", int)}
ARCH = {"--num-layers": ("num_hidden_layers", int), "--hidden-size": ("hidden_size", int),
        "--norm-epsilon": ("rms_norm_eps", float), "--rotary-base": ("rope_theta", float),
        "--num-attention-heads": ("num_attention_heads", int), "--kv-channels": ("head_dim", int)}


def _value(argv, flag):
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_the_data_names_its_source():
    assert DATA["source"] == "Ascend/MindSpeed-LLM" and len(DATA["commit"]) == 40
    families = {path.split("/")[2] for path in LINES}
    assert families == {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_coder_next", "minimax27"}


@pytest.mark.parametrize("path", sorted(LINES), ids=lambda p: p.rsplit("/", 1)[1])
def test_script_translates(path):
    argv = LINES[path]
    try:
        config, report = parse_command_line(list(argv), None)
    except UsageError as exc:
        assert path in LAYOUT_DECLINES, exc.messages
        assert [m for m in exc.messages if not m.startswith(LAYOUT_DECLINES[path])] == [], exc.messages
        return
    assert path not in LAYOUT_DECLINES
    for flag, (group, name, kind) in CHECKED.items():
        if _value(argv, flag) is not None:
            assert getattr(getattr(config, group), name) == kind(_value(argv, flag)), flag
    arch = config.model.architecture
    for flag, (key, kind) in ARCH.items():
        if _value(argv, flag) is not None:
            assert arch[key] == kind(_value(argv, flag)), flag
    if "--num-experts" in argv:
        experts = arch.get("num_experts", arch.get("num_local_experts"))
        assert experts == int(_value(argv, "--num-experts"))
        assert arch["num_experts_per_tok"] == int(_value(argv, "--moe-router-topk"))


def test_minimax_m27_script_routes_with_minimax_sigmoid_router():
    """--moe-router-enable-expert-bias without --moe-router-score-function: the minimax_spec / minimax_m2 model
    routes with sigmoid scores and its checkpoint's bias (model id minimax_m27), not megatron-core's softmax."""
    argv = LINES["examples/mcore/minimax27/pretrain_minimax27_229b_4K_A3_ptd.sh"]
    assert "--moe-router-score-function" not in argv and "--moe-router-enable-expert-bias" in argv
    config, report = parse_command_line(list(argv), None)
    m = config.model
    assert m.model_id == "minimax_m27" and m.moe_router_enable_expert_bias is True
    assert m.moe_router_score_function is None  # the model id's own (sigmoid), not Megatron's softmax default
    assert m.architecture["num_local_experts"] == 256 and m.architecture["intermediate_size"] == 1536
    assert "num_experts" not in m.architecture and "norm_topk_prob" not in m.architecture  # MiniMax's names
    assert m.moe_aux_loss_coeff == [0.001] and m.moe_router_dtype == "fp32"
    assert any(line.startswith("mapped: --spec → model.model_id") for line in report), report


def test_minimax_from_flags_alone_is_declined():
    argv = [a if a != "/your_model_ckpt_path" else "None"
            for a in LINES["examples/mcore/minimax27/pretrain_minimax27_229b_4K_A3_ptd.sh"]]
    with pytest.raises(UsageError) as info:
        parse_command_line(argv, None)
    assert any(m.startswith("--model-type-hf: a MiniMax-M2 model") for m in info.value.messages), info.value.messages
