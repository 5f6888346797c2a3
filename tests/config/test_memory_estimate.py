"""The memory estimate made before anything is built (issue 41): an absurd micro-batch is refused in the process the
user runs, with the numbers, before any index is built (it used to build 6M-sample indices, then die to the OOM
killer with nothing printed); --dry-run prints the estimate; the model states divide by the ranks sharding them
and the activations by tp. benchmarks/bench_memory_estimate.py puts the estimate beside measured peaks."""
import re
import subprocess
import sys

import pytest

from fsdp2_backend.config.memory_estimate import GIB, estimate_memory, fit_errors
from fsdp2_backend.launch import main, parse_command_line
from tests.support.megatron_lines import FAULT_RUN_FLAGS
from tests.support.launchers import ENTRY_ENV
from tests.support.launchers import REPO

MICRO_BATCH = re.compile(r"--(micro|global)-batch-size \d+")


def _flags(*extra):
    return FAULT_RUN_FLAGS + ["--train-iters", "3", *extra]


def test_an_absurd_micro_batch_is_refused_with_the_numbers_before_anything_is_built(tmp_path):
    argv = _flags("--micro-batch-size", "100000", "--global-batch-size", "100000", "--seq-length", "4096",
                  "--max-position-embeddings", "4096", "--save", str(tmp_path / "ckpt"))
    result = subprocess.run([sys.executable, f"{REPO}/pretrain_fsdp2.py", *argv], capture_output=True, text=True,
                            env=ENTRY_ENV, cwd=REPO, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.fullmatch(
        r"error: memory: about [0-9.]+ GiB = parameters [0-9.]+ MiB \+ gradients [0-9.]+ MiB \+ optimizer states "
        r"[0-9.]+ MiB \(fp32, sharded over 1\) \+ gathered layers [0-9.]+ MiB \+ activations [0-9.]+ GiB "
        r"\(micro-batch 100000 x 4096 tokens\) \+ logits [0-9.]+ GiB per rank — 1 rank\(s\) on this host need "
        r"[0-9.]+ GiB and [0-9.]+ GiB of host memory is available; lower --micro-batch-size .*", errors[0]), errors
    assert "building" not in result.stdout and not (tmp_path / "ckpt").exists()  # no index, no save directory


def test_dry_run_prints_the_estimate(capsys):
    assert main(_flags("--dry-run")) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("# memory estimate per rank: ") and "(micro-batch 1 x 32 tokens)" in last, last


def _estimate(world, *extra):
    config, _ = parse_command_line(_flags(*extra), world)
    return estimate_memory(config, world)


def test_states_divide_by_the_shards_and_activations_by_tp():
    one = _estimate(1, "--micro-batch-size", "2", "--global-batch-size", "8")
    four = _estimate(4, "--micro-batch-size", "2", "--global-batch-size", "8", "--tensor-model-parallel-size", "2")
    assert four.shards == 4 and four.parameters == pytest.approx(one.parameters / 4, abs=4)
    assert four.optimizer == pytest.approx(2 * four.parameters, abs=8)  # AdamW: two fp32 moments
    assert four.activations == pytest.approx(one.activations / 2, abs=2) and four.tokens == one.tokens == (2, 32)
    recompute = _estimate(1, "--micro-batch-size", "2", "--global-batch-size", "8", "--recompute-activations")
    assert recompute.activations < one.activations and recompute.states == one.states
    # a device just too small for the estimate is refused, a host with room is not
    assert fit_errors(one, 1, device=one.total - 1, host=100 * GIB, on_cpu=False)[0].endswith(
        "more than the device's " + ("%.1f MiB" % ((one.total - 1) / (1 << 20))) + "; lower --micro-batch-size "
        "(training.per_device_train_batch_size) or --seq-length (data.cutoff_len), shard more (more ranks, "
        "--tensor-model-parallel-size, --context-parallel-size), or set --recompute-activations (parallel.recompute)")
    assert fit_errors(one, 1, device=one.total, host=one.total, on_cpu=False) == []


@pytest.mark.parametrize("name, values", [
    ("llama", dict(model_type="llama", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                   num_key_value_heads=4, intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)),
    ("qwen3 tied", dict(model_type="qwen3", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=32000,
                        tie_word_embeddings=True)),
    ("gpt2", dict(model_type="gpt2", n_embd=768, n_layer=4, n_head=12, vocab_size=32000)),
    ("qwen3_moe", dict(model_type="qwen3_moe", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                       num_key_value_heads=4, head_dim=64, intermediate_size=2816, moe_intermediate_size=512,
                       num_experts=16, num_experts_per_tok=4, vocab_size=32000, tie_word_embeddings=False)),
    ("deepseek_v3", dict(model_type="deepseek_v3", hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                         qk_rope_head_dim=32, v_head_dim=64, intermediate_size=2816, moe_intermediate_size=512,
                         n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                         n_group=1, topk_group=1, vocab_size=32000, tie_word_embeddings=False)),
])
def test_parameter_count_from_the_config_is_the_built_models(name, values):
    """The config-derived count (torch-free, what --dry-run prints) against transformers' model of that config,
    built on the meta device: within 0.5% (biases and per-head norms are left out)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2_backend.config.memory_estimate import parameter_counts

    values = dict(values)
    hf_config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    built = sum(p.numel() for p in model.parameters())
    counts = parameter_counts(hf_config.to_dict())
    assert counts["dense"] + counts["experts"] == pytest.approx(built, rel=5e-3), name
