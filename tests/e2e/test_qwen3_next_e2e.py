"""The qwen3_next model id through the entry point as users run it:
- MindSpeed-LLM's Gated DeltaNet hybrid flags (its qwen3_next launch script's flag set, scaled down) build a
  Qwen3-Next from scratch when no HF directory is given, and train on 2 gloo ranks with expert parallel 2;
- MindSpeed-LLM's own qwen3_next pretraining YAML (tests/data/mindspeed_fsdp2; master's launcher and the v26.1.0
  release's, each with its copy), paths replaced by a tiny Qwen3-Next HF directory and a raw-text parquet, trains
  3 steps on 2 gloo ranks.
"""
import json
import math
import os

import pytest

from tests.support.launchers import REPO, torchrun_command, run_pretrain
from tests.support.launchers import failure_report, run_command, train_lines
from tests.support.mindspeed_yaml import DATA, with_paths, yaml_file_at
from tests.support.mindspeed_yaml import assets  # noqa: F401  (pytest fixture)
from tests.support.tiny_models import tiny_next_dir

GDN_FLAGS = (
    "--qk-layernorm --full-attention-interval 4 --mamba-d-conv 4 --mamba-expand 1 --kv-channels 16 "
    "--linear-key-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 4 --linear-value-head-dim 8 "
    "--partial-rotary-factor 0.25 --max-position-embeddings 64 --num-layers 4 --hidden-size 64 --ffn-hidden-size 96 "
    "--num-attention-heads 4 --rotary-base 10000000 --untie-embeddings-and-output-weights --disable-bias-linear "
    "--position-embedding-type rope --normalization RMSNorm --swiglu --rmsnorm-weight-in-fp32 --add-rmsnorm-offset "
    "--group-query-attention --num-query-groups 2 --norm-epsilon 1e-06 --mamba-chunk-size 8 --num-experts 4 "
    "--moe-router-topk 2 --moe-router-load-balancing-type aux_loss --n-shared-experts 1 --shared-expert-gate "
    "--moe-ffn-hidden-size 32 --moe-grouped-gemm --moe-layer-freq 1 --norm-topk-prob --moe-aux-loss-coeff 0.001 "
    "--micro-batch-size 2 --global-batch-size 4 --seq-length 32 --train-iters 3 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --attention-dropout 0 "
    "--hidden-dropout 0 --log-interval 1 --eval-iters 0 --save-interval 3").split()


def test_gdn_flags_build_and_train_a_qwen3_next_with_ep2(tmp_path):
    lines, log = run_pretrain(GDN_FLAGS, tmp_path / "run", "--expert-model-parallel-size", "2", ranks=2)
    assert sorted(lines) == [1, 2, 3], log[-3000:]
    assert all(math.isfinite(float(loss)) for _, loss in lines.values())
    config = json.loads((tmp_path / "run" / "iter_0000003" / "run_config.json").read_text())
    assert config["model"]["model_id"] == "qwen3_next" and config["optimization"]["gdn_chunk_size"] == 8
    arch = config["model"]["architecture"]
    assert arch["model_type"] == "qwen3_next"
    assert arch["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert (arch["linear_num_key_heads"], arch["linear_num_value_heads"], arch["linear_conv_kernel_dim"],
            arch["shared_expert_intermediate_size"]) == (2, 4, 4, 32)


@pytest.mark.parametrize("commit", ["head", "v26.1.0"])
def test_mindspeed_qwen3_next_yaml_trains_on_two_ranks(assets, tmp_path, commit):  # noqa: F811
    from fsdp2_backend.training.logging import parse_train_line

    table = json.loads((DATA / "launchers.json").read_text())
    entry = table[commit]["examples__fsdp2__qwen3_next__pretrain_qwen3_next_16k_fsdp2_A3.sh"]
    yaml_file = yaml_file_at(commit, entry["yaml"])
    assert yaml_file.parent.name == commit  # each version's own copy
    model = tiny_next_dir(tmp_path / "qwen3-next")
    dataset = json.dumps({"file_name": assets["parquet"]})
    output = str(tmp_path / "output")
    args = with_paths(yaml_file, entry["args"], (model, model, dataset, output))
    args += ["--parallel.fsdp_size", "2", "--parallel.ep_size", "2", "--training.max_steps", "3",
             "--data.cutoff_len", "64", "--training.gradient_accumulation_steps", "1", "--training.save_steps", "3",
             "--optimization.chunk_loss_size", "32", "--training.dataloader_num_workers", "0"]
    command = torchrun_command(2, os.path.join(REPO, "pretrain_fsdp2.py"), str(yaml_file), *args)
    result = run_command(command, {}, timeout=900)
    assert result.returncode == 0, failure_report(result, command)
    log = result.stdout + result.stderr
    assert "use_triton_gdn: no triton Gated DeltaNet kernel on cpu" in log, log[-3000:]
    lines = train_lines(log, parse_train_line)
    assert [line["iteration"] for line in lines] == [1, 2, 3], failure_report(result, command)
    assert all(math.isfinite(line["losses"]["lm loss"]) for line in lines)


def test_mindspeed_gated_deltanet_script_translates_to_a_dense_qwen3_next():
    """MindSpeed's dense Gated DeltaNet 340M launch line (launch corpus) builds from flags: model id qwen3_next,
    every third layer full attention, no experts."""
    from megatron_compat.translate import translate_megatron

    corpus = json.loads((DATA.parent / "launch_corpus.json").read_text())
    (argv,) = [v for k, v in corpus.items() if k.endswith("gated_deltanet/pretrain_gated_deltanet_340M_4K_A2_ptd.sh")]
    fields = translate_megatron(argv).fields
    arch = fields["model"]["architecture"]
    assert fields["model"]["model_id"] == "qwen3_next" and arch["model_type"] == "qwen3_next"
    assert arch["num_experts"] == 0 and arch["layer_types"][:3] == ["linear_attention"] * 2 + ["full_attention"]
    assert (arch["linear_num_key_heads"], arch["linear_key_head_dim"], arch["linear_conv_kernel_dim"]) == (4, 256, 4)
    assert fields["optimization"]["use_triton_gdn"] is True and fields["optimization"]["gdn_chunk_size"] == 64
