"""Translation of Megatron/MindSpeed flags: every flag lands in exactly one disposition, and the exact mappings."""
import argparse

import pytest

from fsdp2_backend.config import GROUPS, Config
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.parse.arguments import build_parser, defaults, option_strings
from megatron_compat.translate import report_lines, translate_megatron, translate_report

from tests.support.megatron_lines import TRANSLATE_BASE_FLAGS

LLAMA = TRANSLATE_BASE_FLAGS + ("--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear "
               "--hidden-dropout 0").split()


def _non_default_argv(action: argparse.Action):
    """argv that sets the action's dest to a value other than its default (None if it cannot)."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    default = action.default
    if action.choices:
        choice = next(c for c in action.choices if c != default and [c] != default)
        return [flag, str(choice)]
    tp = action.type
    if tp is int:
        value = str((default if isinstance(default, int) else 0) + 2)
    elif tp is float:
        value = str((default if isinstance(default, float) else 0.0) + 0.5)
    elif getattr(tp, "__name__", "") in ("_freq",):
        value = "2"
    elif getattr(tp, "__name__", "") == "_int_tuple":
        value = "4,0"
    elif getattr(tp, "__name__", "") == "_bool":
        value = "true"
    else:
        value = "x-value"
    return [flag] + [value] * (action.nargs if isinstance(action.nargs, int) else 1)


ACTIONS = [a for a in build_parser()._actions if a.option_strings and a.dest != "help"]
OPTIONS = option_strings()


def _dest_of(flag):
    return next(dest for dest, opts in OPTIONS.items() if flag in opts)


def test_base_line_translates_cleanly():
    translation = translate_megatron(TRANSLATE_BASE_FLAGS)
    assert translation.report.declined == []


# The same model, defined by an HF directory instead (architecture flags are then checked, not built).
HF_BASE = TRANSLATE_BASE_FLAGS + ["--load", "/hf/model", "--save", "/out"]


def _disposition_defects(base):
    defects = []
    for action in ACTIONS:
        argv = _non_default_argv(action)
        try:
            report = translate_report(base + argv).report
        except UsageError as exc:
            defects.append(f"{argv}: refused: {exc.messages}")
            continue
        flag = argv[0]
        kinds = [kind for kind, flags in (("mapped", [f for f, _ in report.mapped]), ("no_effect", report.no_effect),
                                          ("declined", [f for f, _ in report.declined])) if flag in flags]
        if len(kinds) != 1:
            defects.append(f"{flag} ({action.dest}) is in {kinds or 'no list'}")
        elif kinds == ["declined"]:
            why = dict(report.declined)[flag]
            if " — " not in why or "no FSDP2 meaning is known" in why:
                defects.append(f"{flag}: declined without a listed reason and remedy: {why}")
    return defects


@pytest.mark.parametrize("base", [TRANSLATE_BASE_FLAGS, HF_BASE], ids=["from-scratch", "hf-directory"])
def test_every_flag_lands_in_exactly_one_disposition(base):
    """Each of the ~1150 known flags, set to a value other than its default, is mapped, without effect or declined."""
    assert len(ACTIONS) > 1100
    assert _disposition_defects(base) == []


def test_declined_flags_raise_one_message_each():
    with pytest.raises(UsageError) as err:
        translate_megatron(TRANSLATE_BASE_FLAGS + ["--moe-expert-capacity-factor", "1.5", "--mtp-detach-heads",
                                                   "--moe-use-sinkhorn"])
    messages = err.value.messages
    assert sorted(m.split(":")[0] for m in messages) == ["--moe-expert-capacity-factor", "--moe-use-sinkhorn",
                                                          "--mtp-detach-heads"]
    assert all(" — " in m for m in messages)


def test_no_effect_report_is_one_line():
    translation = translate_megatron(TRANSLATE_BASE_FLAGS + "--use-distributed-optimizer --overlap-grad-reduce "
                                            "--transformer-impl local --no-masked-softmax-fusion".split())
    lines = report_lines(translation.report)
    no_effect = [line for line in lines if line.startswith("accepted without effect under FSDP2: ")]
    assert no_effect == ["accepted without effect under FSDP2: --use-distributed-optimizer, --overlap-grad-reduce, "
                         "--transformer-impl, --no-masked-softmax-fusion"]


def test_global_batch_gives_gradient_accumulation():
    """The front end maps --global-batch-size; validation derives the accumulation once, for the world size."""
    from fsdp2_backend.config.validation import validate

    def accumulation(argv, world):
        fields = translate_megatron(argv, world_size=world).fields
        assert fields["training"]["global_batch_size"] == 8 and "gradient_accumulation_steps" not in fields["training"]
        config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
        return validate(config, world).training.gradient_accumulation_steps

    assert accumulation(TRANSLATE_BASE_FLAGS + ["--tensor-model-parallel-size", "2"], 8) == 1  # 8 / (2 × 8 / 2)
    assert accumulation(TRANSLATE_BASE_FLAGS, 2) == 2  # 8 / (2 × 2)
    with pytest.raises(UsageError) as err:
        accumulation(TRANSLATE_BASE_FLAGS, 3)
    assert err.value.messages[0].startswith("training.global_batch_size: 8 is not divisible by micro batch 2 x "
                                            "data-parallel size 3")


def test_blend_syntax_is_kept():
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + ["--data-path", "0.3", "/d/a_text_document", "0.7", "/d/b_text_document",
                                        "--split", "949,50,1"]).fields
    assert fields["data"]["dataset"] == ["0.3", "/d/a_text_document", "0.7", "/d/b_text_document"]
    assert fields["data"]["split"] == "949,50,1"
    assert translate_megatron(TRANSLATE_BASE_FLAGS + ["--data-path", "/d/a"]).fields["data"]["split"] == "969,30,1"


@pytest.mark.parametrize("algo, cp_type", [("ulysses_cp_algo", "ulysses"), ("megatron_cp_algo", "ring"),
                                           ("hybrid_cp_algo", "ring")])
def test_context_parallel_algorithms(algo, cp_type):
    translation = translate_megatron(LLAMA + ["--context-parallel-size", "2", "--context-parallel-algo", algo],
                                     world_size=2)
    assert translation.fields["parallel"]["cp_size"] == 2
    assert translation.fields["parallel"]["cp_type"] == cp_type
    assert bool(translation.report.warnings) == (algo == "hybrid_cp_algo")


def test_megatron_cp_defaults_to_ring_and_follows_cp_comm_type():
    assert translate_megatron(TRANSLATE_BASE_FLAGS + ["--context-parallel-size", "2"], world_size=2).fields["parallel"]["cp_type"] \
        == "ring"
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--context-parallel-size 2 --cp-comm-type a2a".split(), world_size=2).fields
    assert fields["parallel"]["cp_type"] == "ulysses"


def test_recompute_full_block_lists_the_first_layers_of_each_stage():
    argv = LLAMA + "--num-layers 8 --recompute-granularity full --recompute-method block --recompute-num-layers 1 " \
                   "--pipeline-model-parallel-size 2".split()
    translation = translate_megatron(argv)
    parallel = translation.fields["parallel"]
    assert parallel["recompute"] is True
    assert parallel["recompute_modules"] == ["model.layers.0", "model.layers.4"]
    assert any("folded into FSDP" in w for w in translation.report.warnings)


def test_recompute_selective_and_uniform():
    parallel = translate_megatron(TRANSLATE_BASE_FLAGS + ["--recompute-activations"]).fields["parallel"]
    assert parallel["recompute_modules"] == ["model.layers.{*}.self_attn"]
    parallel = translate_megatron(TRANSLATE_BASE_FLAGS + "--recompute-granularity full --recompute-method uniform "
                                         "--recompute-num-layers 1".split()).fields["parallel"]
    assert parallel["recompute_modules"] == ["model.layers.{*}"]
    report = translate_megatron(TRANSLATE_BASE_FLAGS + ["--recompute-num-layers", "2"]).report
    assert "--recompute-num-layers" in report.no_effect


def test_architecture_from_scratch_is_a_buildable_hf_config():
    argv = LLAMA + "--group-query-attention --num-query-groups 2 --rotary-base 1000000 --norm-epsilon 1e-6 " \
                   "--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0".split()
    fields = translate_megatron(argv).fields
    arch = fields["model"]["architecture"]
    assert arch["model_type"] == "llama"
    assert arch["hidden_size"] == 64 and arch["num_hidden_layers"] == 2 and arch["num_attention_heads"] == 4
    assert arch["num_key_value_heads"] == 2 and arch["head_dim"] == 16
    assert arch["intermediate_size"] == 128  # Megatron's SwiGLU rule: int(4h·2/3 / 64)·64
    assert arch["vocab_size"] == 100  # as given: the engine pads it (divisible-by x tp) in one place
    assert fields["model"]["make_vocab_size_divisible_by"] == 128
    assert arch["rope_theta"] == 1e6 and arch["rms_norm_eps"] == 1e-6 and arch["tie_word_embeddings"] is False
    assert arch["hidden_act"] == "silu" and arch["attention_bias"] is False
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**arch)
    assert config.num_key_value_heads == 2 and config.intermediate_size == 128


def test_default_megatron_gpt_is_gpt2_with_4h_ffn():
    arch = translate_megatron(TRANSLATE_BASE_FLAGS).fields["model"]["architecture"]
    assert arch["model_type"] == "gpt2" and arch["n_inner"] == 256 and arch["n_embd"] == 64
    assert arch["activation_function"] == "gelu" and arch["resid_pdrop"] == 0.1
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoConfig.for_model(**arch).n_inner == 256


def test_qwen3_flags_with_an_hf_directory_only_carry_what_the_script_says(tmp_path):
    (tmp_path / "qwen3").mkdir()
    (tmp_path / "qwen3" / "config.json").write_text('{"model_type": "qwen3"}')
    argv = (f"--load {tmp_path}/qwen3 --save /out --num-layers 28 --hidden-size 2048 --num-attention-heads 16 "
            "--group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm --swiglu "
            "--normalization RMSNorm --position-embedding-type rope --micro-batch-size 1 --train-iters 5 "
            "--tokenizer-type PretrainedFromHF --tokenizer-name-or-path /tok --seq-length 64").split()
    fields = translate_megatron(argv).fields
    assert fields["model"]["model_name_or_path"] == f"{tmp_path}/qwen3"
    assert fields["model"]["tokenizer_name_or_path"] == "/tok" and "tokenizer_type" not in fields["model"]
    arch = fields["model"]["architecture"]
    assert "model_type" not in arch and "intermediate_size" not in arch  # the HF config defines those
    assert arch["num_key_value_heads"] == 8 and arch["head_dim"] == 128
    assert "initializer_range" not in arch  # loaded weights are not initialised


def test_hf_directory_checks_pass_for_a_matching_config(tmp_path):
    """The keys built from a MindSpeed-style qwen3 line agree with a matching config.json (no false mismatch)."""
    import json

    from fsdp2_backend.config import validation as config_validation
    hf = {"model_type": "qwen3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "max_position_embeddings": 40960,
          "rope_theta": 1000000, "rms_norm_eps": 1e-6, "vocab_size": 128, "tie_word_embeddings": False,
          "attention_bias": False, "hidden_act": "silu", "initializer_range": 0.02}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    argv = (f"--load {tmp_path} --num-layers 2 --hidden-size 64 --num-attention-heads 4 --group-query-attention "
            "--num-query-groups 2 --kv-channels 16 --ffn-hidden-size 96 --max-position-embeddings 4096 "
            "--rotary-base 1000000 --norm-epsilon 1e-6 --padded-vocab-size 128 --untie-embeddings-and-output-weights "
            "--disable-bias-linear --swiglu --normalization RMSNorm --position-embedding-type rope --qk-layernorm "
            "--init-method-std 0.01 --micro-batch-size 1 --train-iters 2 --seq-length 32 --bf16 --mock-data").split()
    fields = translate_megatron(argv).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    config_validation.validate(config, 1)
    hf["num_key_value_heads"] = 4
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UsageError) as err:
        config_validation.validate(config, 1)
    assert "num_key_value_heads" in err.value.messages[0]


def test_moe_flags_map_to_hf_keys():
    argv = LLAMA + "--qk-layernorm --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 " \
                   "--moe-aux-loss-coeff 1e-2 --hidden-dropout 0".split()
    arch = translate_megatron(argv).fields["model"]["architecture"]
    assert arch["model_type"] == "qwen3_moe"
    assert (arch["num_experts"], arch["num_experts_per_tok"], arch["moe_intermediate_size"]) == (4, 2, 32)
    # Qwen3-MoE runs this project's router (models/moe/router.py): Megatron's loss, not transformers' aux loss
    model = translate_megatron(argv).fields["model"]
    assert (model["moe_router_load_balancing_type"], model["moe_aux_loss_coeff"]) == ("aux_loss", [1e-2])
    assert "router_aux_loss_coef" not in arch and "output_router_logits" not in arch
    assert arch["norm_topk_prob"] is True
    fields = translate_megatron(argv + "--first-k-dense-replace 1 --moe-layer-freq 2".split()).fields
    arch = fields["model"]["architecture"]
    assert arch["mlp_only_layers"] == [0] and arch["decoder_sparse_step"] == 2
    model = translate_megatron(argv + "--moe-router-num-groups 2 --moe-router-group-topk 1".split()).fields["model"]
    assert (model["moe_router_num_groups"], model["moe_router_group_topk"]) == (2, 1)


def test_precision_save_load_and_megatron_defaults():
    fields = translate_megatron(TRANSLATE_BASE_FLAGS).fields
    assert fields["parallel"]["param_dtype"] == "fp32"  # neither --bf16 nor --fp16
    assert fields["training"]["save_checkpoints"] is False and "output_dir" not in fields["training"]
    assert fields["model"]["train_from_scratch"] is True
    t = fields["training"]
    assert (t["lr_scheduler_type"], t["adam_beta2"], t["seed"], t["logging_steps"], t["min_lr"], t["warmup_ratio"]) \
        == ("linear", 0.999, 1234, 100, 0.0, 0.0)
    assert (t["stage"], fields["data"]["data_manager_type"]) == ("pt", "mg")
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--bf16 --save /out --load /out --save-interval 5".split()).fields
    assert fields["parallel"]["param_dtype"] == "bf16"
    assert fields["training"]["output_dir"] == "/out" and fields["training"]["save_steps"] == 5
    assert fields["training"]["resume_from_checkpoint"] == "/out"  # Megatron's --load X --save X resume pattern


def test_training_flags():
    argv = TRANSLATE_BASE_FLAGS + ("--train-samples 1000 --exit-interval 7 --eval-interval 5 --eval-iters 3 --no-load-optim "
                   "--lr-decay-style cosine --lr-warmup-iters 2 --lr-decay-iters 9 --clip-grad 0.5 "
                   "--weight-decay 0.1 --adam-eps 1e-6 --tensorboard-dir /tb --calculate-per-token-loss").split()
    t = translate_megatron(argv).fields["training"]
    assert (t["train_samples"], t["exit_interval"], t["eval_interval"], t["eval_iters"]) == (1000, 7, 5, 3)
    assert (t["no_load_optim"], t["lr_scheduler_type"], t["lr_warmup_iters"], t["lr_decay_iters"]) == \
        (True, "cosine", 2, 9)
    assert (t["max_grad_norm"], t["weight_decay"], t["adam_epsilon"], t["tensorboard_dir"]) == \
        (0.5, 0.1, 1e-6, "/tb")
    assert t["calculate_per_token_loss"] is True


def test_shell_residue_is_expanded_with_a_warning():
    argv = TRANSLATE_BASE_FLAGS + ["--pipeline-model-parallel-size", "$((${GPUS_PER_NODE:-8}*${NUM_NODES:-1}))",
                   "--save", "${1:-checkpoints/x}", "if", "[", "!", "-f", "x", "];", "then", "fi"]
    translation = translate_megatron(argv)
    assert translation.fields["training"]["output_dir"] == "checkpoints/x"
    assert any("ignored shell syntax" in w for w in translation.report.warnings)
    assert any("folded into FSDP" in w for w in translation.report.warnings)


def test_translated_fields_build_a_config():
    fields = translate_megatron(LLAMA + ["--bf16", "--save", "/out"]).fields
    config = Config(**{group: GROUPS[group](**values) for group, values in fields.items()})
    assert config.parallel.param_dtype == "bf16"


def test_every_default_is_exposed():
    assert len(defaults()) >= 839 - 1 - 1  # help excluded; yarn's two flags share one dest


def test_a_model_from_scratch_needs_megatrons_required_flags(tmp_path):
    argv = TRANSLATE_BASE_FLAGS[2:]
    assert TRANSLATE_BASE_FLAGS[:2] == ["--num-layers", "2"]
    with pytest.raises(UsageError) as err:
        translate_megatron(argv)
    assert err.value.messages == ["--num-layers: required to build the model (no --load with an HF directory or a "
                                  "checkpoint, no model in the YAML) — give it"]
    (tmp_path / "config.json").write_text("{}")
    translate_megatron(argv + ["--load", str(tmp_path)])  # the HF directory defines the model
    # A checkpoint directory given with architecture flags must describe the whole model (built while it is empty)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(UsageError):
        translate_megatron(argv + ["--load", str(tmp_path / "ckpt")])


def test_profiling_and_sequence_parallel_follow_megatron():
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--profile --sequence-parallel".split()).fields
    profiling = {k: v for k, v in fields["profiling"].items() if k in ("profile", "profile_step_start",
                                                                      "profile_step_end", "profile_ranks")}
    assert profiling == {"profile": True, "profile_step_start": 10, "profile_step_end": 12,
                         "profile_ranks": [-1]}  # Megatron: no --profile-ranks profiles every rank
    assert fields["parallel"]["sequence_parallel"] is False  # Megatron turns it off without tensor parallel
    assert fields["training"]["num_train_epochs"] == 0.0
    fields = translate_megatron(TRANSLATE_BASE_FLAGS + "--profile --profile-ranks 0 1 --sequence-parallel "
                                       "--tensor-model-parallel-size 2".split(), world_size=2).fields
    assert fields["profiling"]["profile_ranks"] == [0, 1] and fields["parallel"]["sequence_parallel"] is True


def test_handlers_and_architecture_flags_are_disjoint():
    from megatron_compat.architecture.flags import ARCHITECTURE_DESTS, HF_DEFINED_DESTS
    from megatron_compat.translate.handlers import HANDLERS
    assert not (set(HANDLERS) & (ARCHITECTURE_DESTS | HF_DEFINED_DESTS))
    assert not (ARCHITECTURE_DESTS & HF_DEFINED_DESTS)
    known = set(defaults())
    assert (set(HANDLERS) | ARCHITECTURE_DESTS | HF_DEFINED_DESTS) <= known


def test_flags_named_at_their_default_are_still_reported_when_without_effect():
    report = translate_megatron(TRANSLATE_BASE_FLAGS + ["--transformer-impl", "transformer_engine"]).report
    assert "--transformer-impl" in report.no_effect


def test_sources_name_the_flag_behind_each_field():
    sources = translate_megatron(TRANSLATE_BASE_FLAGS + ["--lr", "2e-3"]).sources
    assert sources["training.lr"] == "--lr"
    assert sources["training.adam_beta2"] == "(Megatron default)"
    assert sources["training.per_device_train_batch_size"] == "--micro-batch-size"
    assert sources["model.architecture"].startswith("--num-layers, --hidden-size")


def test_expert_bias_maps_for_qwen3_moe_and_mixtral():
    argv = LLAMA + "--qk-layernorm --num-experts 4 --moe-router-enable-expert-bias --moe-router-score-function " \
                   "sigmoid --moe-router-bias-update-rate 0.01 --hidden-dropout 0".split()
    model = translate_megatron(argv).fields["model"]
    assert (model["moe_router_enable_expert_bias"], model["moe_router_bias_update_rate"]) == (True, 0.01)
    # without --qk-layernorm: a Mixtral, with the project's router too (models/moe/family_swap.py)
    fields = translate_megatron([a for a in argv if a != "--qk-layernorm"]).fields
    assert fields["model"]["architecture"]["model_type"] == "mixtral"
    assert (fields["model"]["moe_router_enable_expert_bias"], fields["model"]["moe_router_bias_update_rate"]) == \
        (True, 0.01)


@pytest.mark.parametrize("flag", ["--tensor-model-parallel-size", "--micro-batch-size", "--num-attention-heads",
                                  "--make-vocab-size-divisible-by"])
def test_zero_sizes_are_usage_errors(flag):
    with pytest.raises(UsageError) as err:
        translate_megatron(TRANSLATE_BASE_FLAGS + [flag, "0"], world_size=2)
    assert err.value.messages == [f"{flag}: must be at least 1, got 0 — give a positive number"]


def test_megatron_samplers_drop_the_last_incomplete_group():
    translation = translate_megatron(TRANSLATE_BASE_FLAGS, world_size=1)
    assert translation.fields["training"]["dataloader_drop_last"] is True
    assert translation.sources["training.dataloader_drop_last"] == "(Megatron default)"
