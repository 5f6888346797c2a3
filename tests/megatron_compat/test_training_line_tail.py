"""The training-line tail of issue 28: Megatron flags that used to decline lines, with Megatron's meaning.

- --fp8-format / --fp8-recipe tensorwise and blockwise → the FP8 recipes (model.quant_recipe_name, E5M2 gradients
  with hybrid), delayed (Megatron's default) → the delayed recipe with its history flags, custom declined with the
  reason; the delayed recipe's own flags have no effect otherwise;
- --first-last-layers-bf16 with --num-layers-at-start/end-in-bf16 → those decoder layers in quant_ignored_modules
  (the recipe's defaults kept), no effect without --fp8-format;
- --vocab-size sizes the model only for NullTokenizer / TikTokenizer (Megatron pads the tokenizer's own
  vocabulary otherwise: the flag is unread);
- --recompute-modules: Megatron's seven module names map onto the recompute stage's patterns.
"""
import pytest

from fsdp2_backend.launch import parse_command_line
from fsdp2_backend.usage_errors import UsageError
from megatron_compat.translate import translate_megatron

BASE = ("--num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 10 --lr 1e-4 --bf16 --swiglu "
        "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear --hidden-dropout 0 "
        "--qk-layernorm --tokenizer-type HuggingFaceTokenizer --tokenizer-model /tok --data-path /d --save /o").split()


def _model(extra):
    config, _ = parse_command_line(BASE + extra.split(), None)
    return config.model


@pytest.mark.parametrize("flags, recipe, fmt", [("--fp8-format hybrid --fp8-recipe tensorwise", "tensorwise", "hybrid"),
                                                ("--fp8-format e4m3 --fp8-recipe blockwise", "blockwise", "e4m3")])
def test_fp8_recipes_map_to_the_float8_recipes(flags, recipe, fmt):
    m = _model(flags + " --fp8-param-gather")
    assert (m.quant_recipe_name, m.quant_fp8_format, m.quant_converters) == (recipe, fmt, ["quantize.linear.float8"])
    assert m.enable_fsdp_low_precision_all_gather is True


def test_delayed_recipe_takes_its_flags_which_are_unread_elsewhere():
    m = _model("--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-margin 2")
    assert (m.quant_recipe_name, m.quant_fp8_format, m.quant_converters) == ("delayed", "hybrid",
                                                                              ["quantize.linear.float8"])
    assert (m.quant_fp8_amax_history_len, m.quant_fp8_amax_compute_algo, m.quant_fp8_margin) == (1024, "max", 2)
    report = translate_megatron(BASE + "--fp8-format hybrid --fp8-recipe tensorwise --fp8-margin 2".split()).report
    assert report.no_effect_reasons["--fp8-margin"] == "read only by --fp8-recipe delayed"


def test_first_last_layers_bf16_names_those_layers():
    m = _model("--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 --num-layers-at-start-in-bf16 2 "
               "--num-layers-at-end-in-bf16 3")
    assert m.quant_ignored_modules == ["*lm_head", "*gate", "model.layers.0", "model.layers.1", "model.layers.3",
                                       "model.layers.4", "model.layers.5"]
    assert _model("--fp8-format e4m3 --fp8-recipe mxfp8 --first-last-layers-bf16").quant_ignored_modules[2:] == \
        ["model.layers.0", "model.layers.5"]  # Megatron's defaults: one layer at each end
    report = translate_megatron(BASE + ["--first-last-layers-bf16"]).report
    assert report.no_effect_reasons["--first-last-layers-bf16"] == "read only with --fp8-format"


def test_vocab_size_is_read_only_by_the_tokenizers_megatron_sizes_from_it():
    translation = translate_megatron(BASE + "--vocab-size 1000".split())
    assert "vocab_size" not in translation.fields["model"]["architecture"]
    assert "--vocab-size" in translation.report.no_effect
    null = [a for a in BASE if a not in ("--tokenizer-model", "/tok")]
    null[null.index("HuggingFaceTokenizer")] = "NullTokenizer"
    fields = translate_megatron(null + "--vocab-size 1000".split()).fields["model"]
    assert fields["architecture"]["vocab_size"] == 1000 and fields["vocab_size"] == 1000


def test_recompute_modules_map_onto_the_recompute_stage():
    config, _ = parse_command_line(BASE + "--recompute-granularity selective --recompute-modules core_attn mlp "
                                          "layernorm".split(), None)
    assert config.parallel.recompute
    assert config.parallel.recompute_modules == ["model.layers.{*}.self_attn", "model.layers.{*}.mlp",
                                                 "model.layers.{*}.input_layernorm",
                                                 "model.layers.{*}.post_attention_layernorm"]
    with pytest.raises(UsageError) as err:
        translate_megatron(BASE + "--recompute-granularity selective --recompute-modules mhc".split())
    assert err.value.messages[0].startswith("--recompute-modules: unknown module 'mhc'")
