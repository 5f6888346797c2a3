"""`optimization.torch_compile`: read from a YAML-style override and Megatron argv, and said once (a notice) for a
model whose blocks compile in pieces (routed experts); a dense model gets no notice."""
from fsdp2_backend.config import Config
from fsdp2_backend.config.validation import validate, validate_with_notices
from fsdp2_backend.launch import parse_command_line

ARCH = dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=128)
MOE = dict(ARCH, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _notices(architecture, compiled=True):
    config = Config()
    config.training.stage, config.data.data_manager_type = "pt", "mg"
    config.model.architecture = architecture
    config.data.mock_data = True
    config.training.save_checkpoints = False
    config.optimization.torch_compile = compiled
    return [n for n in validate_with_notices(config)[1] if n.startswith("optimization.torch_compile")]


def test_moe_blocks_compiling_in_pieces_is_said_once():
    notices = _notices(MOE)
    assert len(notices) == 1 and "qwen3_moe's MoE decoder blocks compile in pieces" in notices[0]
    assert "bincount" in notices[0]
    assert _notices(MOE, compiled=False) == []
    assert _notices(ARCH) == []  # dense blocks: one graph each, nothing to say


def test_megatron_argv_takes_the_native_switch():
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 128 --optimization.torch_compile True").split()
    config, _ = parse_command_line(argv, 1)
    assert config.optimization.torch_compile is True
    config, _ = parse_command_line(argv[:-2], 1)
    assert config.optimization.torch_compile is False


def test_mxfp8_weights_are_declined_and_the_float8_recipes_compile():
    """MXFP8 weights (a tensor subclass) and MXFP8 grouped experts (data-sized blocks) do not trace: one error naming
    both fields; a float8 recipe passes."""
    import pytest

    from fsdp2_backend.usage_errors import UsageError

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 128 --bf16 --fp8-format e4m3 --optimization.torch_compile True").split()
    with pytest.raises(UsageError) as error:
        parse_command_line(argv + ["--fp8-recipe", "mxfp8"], 1)
    assert "optimization.torch_compile: model.quant_converters quantize.linear.mx" in str(error.value)
    config, _ = parse_command_line(argv + ["--fp8-recipe", "mxfp8", "--optimization.torch_compile", "False"], 1)
    config.model.quant_converters = ["quantize.moe.mx"]  # the native field: MXFP8 grouped experts only
    config.optimization.torch_compile = True
    with pytest.raises(UsageError, match="quant_converters quantize.moe.mx "):
        validate(config, 1)
    config, _ = parse_command_line(argv + ["--fp8-recipe", "tensorwise"], 1)
    assert config.model.quant_recipe_name == "tensorwise" and config.optimization.torch_compile is True
