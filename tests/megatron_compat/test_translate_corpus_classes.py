"""Launch-line forms that real scripts use and that were declined (issue 40): each translates to what Megatron
does with it, or is declined as what it is.

Expected values are Megatron's own rules written out here (its validate_args arithmetic, its padding rule),
with non-default values throughout."""
import pytest

from fsdp2_backend.launch import parse_for_world
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.parse.arguments import parse_megatron
from megatron_compat.translate import translate_megatron, translate_report
from tests.support.megatron_lines import SMALL_LLAMA_LINE

LINE = SMALL_LLAMA_LINE


def test_dry_run_without_world_size_counts_distributed_optimizer_instances():
    # tp 2 × 3 instances: the smallest valid world is 6 (dp 3, one rank per instance); the line was declined at
    # the tp-only world 2 ("3 instances do not divide the data-parallel size 1")
    argv = LINE + "--tensor-model-parallel-size 2 --num-distributed-optimizer-instances 3".split()
    config, report, world = parse_for_world(argv, None)
    assert world == 6 and config.parallel.tp_size == 2
    assert any("validated for world size 6" in line for line in report)
    # with cp 2 and 2 instances of 2 ranks each (dp 4 at world 16 would also be valid): the smallest is 8
    argv = LINE + "--context-parallel-size 2 --tensor-model-parallel-size 2 --num-distributed-optimizer-instances 2" \
        .split()
    assert parse_for_world(argv, None)[2] == 8
    with pytest.raises(UsageError, match="3 instances do not divide the data-parallel size 2"):
        parse_for_world(LINE + "--num-distributed-optimizer-instances 3".split(), 2)  # WORLD_SIZE given: checked


def test_vocab_size_with_padded_vocab_size_builds_the_padded_embedding():
    # MindSpeed's --padded-vocab-size gives the embedding's rows; --vocab-size the NullTokenizer's tokens in them
    t = translate_megatron(LINE + ["--padded-vocab-size", "1152"])
    assert t.fields["model"]["architecture"]["vocab_size"] == 1152
    assert any(flag == "--vocab-size" and "1152" in target for flag, target in t.report.mapped)
    with pytest.raises(UsageError, match="--vocab-size: 1000 tokens do not fit in --padded-vocab-size 960"):
        translate_megatron(LINE + ["--padded-vocab-size", "960"])


def test_vocab_size_of_a_flags_only_mla_moe_model_is_padded_as_megatron_pads():
    argv = LINE + ("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
                   "--qk-pos-emb-head-dim 8 --v-head-dim 16 --num-experts 4 --moe-router-topk 2 "
                   "--moe-ffn-hidden-size 32 --make-vocab-size-divisible-by 96 --tensor-model-parallel-size 2 "
                   "--untie-embeddings-and-output-weights").split()
    config, _, _ = parse_for_world(argv, None)
    from fsdp2_backend.data.tokenizer import padded_vocab_size

    assert config.model.architecture["model_type"] == "deepseek_v3"
    assert config.model.architecture["vocab_size"] == 1000
    # Megatron's _vocab_size_with_padding: the next multiple of divisible_by × tp = 192 → 1152
    assert padded_vocab_size(1000, config.model.make_vocab_size_divisible_by, config.parallel.tp_size) == 1152


@pytest.mark.parametrize("argv, dest, expected", [
    (["--recompute-modules", "[layernorm mla_up_proj mlp moe_act]"], "recompute_modules",
     ["layernorm", "mla_up_proj", "mlp", "moe_act"]),
    (["--recompute-modules", "[core_attn,", "moe]"], "recompute_modules", ["core_attn", "moe"]),  # unquoted
    (["--hierarchical-context-parallel-sizes", "[2 3]"], "hierarchical_context_parallel_sizes", [2, 3]),
    (["--hierarchical-context-parallel-sizes=[3,2]"], "hierarchical_context_parallel_sizes", [3, 2]),
])
def test_bracketed_list_values_as_megatron_test_yamls_write_them(argv, dest, expected):
    assert getattr(parse_megatron(argv).namespace, dest) == expected


def test_bracketed_recompute_modules_translate():
    bracketed = translate_megatron(LINE + ["--recompute-granularity", "selective", "--recompute-modules",
                                           "[layernorm mlp]"])
    words = translate_megatron(LINE + ["--recompute-granularity", "selective", "--recompute-modules", "layernorm",
                                       "mlp"])
    assert bracketed.fields["parallel"] == words.fields["parallel"]
    assert "model.layers.{*}.mlp" in bracketed.fields["parallel"]["recompute_modules"]


def test_eval_global_batch_size_sets_the_evaluated_samples():
    # 3 iterations of 20 samples = 60 samples = 5 global batches of 12; the micro-batch split changes no loss
    t = translate_report(LINE + "--eval-iters 3 --eval-interval 5 --eval-global-batch-size 20 "
                                "--eval-micro-batch-size 4".split())
    assert t.fields["training"]["eval_iters"] == 5 and not t.report.declined
    assert "--eval-micro-batch-size" in t.report.no_effect
    with pytest.raises(UsageError, match="--eval-global-batch-size: --eval-iters 3 × 10 samples"):
        translate_megatron(LINE + "--eval-iters 3 --eval-interval 5 --eval-global-batch-size 10".split())


def test_modelopt_post_training_arguments_are_known_and_declined_as_what_they_are():
    report = translate_report(LINE + ["--export-te-mcore-model", "--export-default-te-spec", "--export-kd-teacher-load",
                                      "/teacher", "--export-kd-cfg", "kd.yaml", "--export-quant-cfg", "fp8"]).report
    declined = dict(report.declined)
    assert set(declined) == {"--export-kd-teacher-load", "--export-kd-cfg", "--export-quant-cfg"}
    assert "knowledge distillation" in declined["--export-kd-cfg"]
    assert "ModelOpt quantisation" in declined["--export-quant-cfg"]
    # the Transformer Engine layer spec of ModelOpt's builder: the same model, a checkpoint-layout choice
    assert {"--export-te-mcore-model", "--export-default-te-spec"} <= set(report.no_effect)


@pytest.mark.parametrize("extra", [[], ["--moe-router-pre-softmax"]])
def test_norm_topk_prob_is_what_a_mixtral_style_router_does(extra):
    t = translate_report(LINE + "--num-experts 6 --moe-router-topk 3 --norm-topk-prob".split() + extra)
    assert not t.report.declined
    assert t.fields["model"]["architecture"]["model_type"] == "mixtral"
    assert "moe_router_pre_softmax" not in t.fields["model"]  # renormalised over k: Mixtral's own router
    mapped = dict(t.report.mapped)
    assert "renormalises the top-k" in mapped["--norm-topk-prob"]
    # without --norm-topk-prob, Megatron's pre-softmax keeps the k scores unnormalised: the router switch
    plain = translate_report(LINE + "--num-experts 6 --moe-router-topk 3 --moe-router-pre-softmax".split())
    assert plain.fields["model"]["moe_router_pre_softmax"] is True


def test_nsys_profile_options_read_off_a_script_are_dropped_with_a_warning():
    # Megatron-LM's megatron_fsdp example runs the launcher under `nsys profile --sample=none ... -o OUT`: read off
    # the script, those options land in the line; none is a training argument
    argv = LINE + ["--sample=none", "--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "-f", "true", "-o",
                   "nsys_profiles/run", "--log-interval", "3"]
    t = translate_report(argv)
    assert not t.report.declined and t.fields["training"]["logging_steps"] == 3
    (warning,) = [w for w in t.report.warnings if "Nsight Systems" in w]
    assert "--sample=none" in warning and "-o nsys_profiles/run" in warning
