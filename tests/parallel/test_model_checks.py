"""The second validation phase (`parallel.model_checks`): the built model against the layout, every stage's problems
in one error, before any stage (or any mesh) is touched."""
from types import SimpleNamespace

import pytest

from tests.support.tiny_models import TINY_CONFIGS

pytestmark = pytest.mark.unit


def _moe_model(**overrides):
    from fsdp2_backend.models.qwen3_moe.modeling import build_qwen3_moe, configure_moe

    config = TINY_CONFIGS["qwen3_moe"]()  # 4 query / 2 key-value heads, 4 experts
    for name, value in overrides.items():
        setattr(config, name, value)
    model = build_qwen3_moe(config)
    configure_moe(model, moe_grouped_gemm=True, fix_router=False)
    return model


def _layout(**fields):
    from fsdp2_backend.config import ParallelArguments

    return SimpleNamespace(parallel=ParallelArguments(**fields))


def test_every_stage_problem_in_one_error():
    from fsdp2_backend.parallel.model_checks import built_model_problems, check_built_model
    from fsdp2_backend.usage_errors import UsageError

    model = _moe_model(attention_dropout=0.25)
    layout = _layout(tp_size=3, ep_size=3, cp_size=2, cp_type="ulysses", ep_fsdp_modules=["model.layers.{*}.mlp"])
    problems = built_model_problems(model, layout)
    expected = ["num_attention_heads=4 is not divisible by tp_size=3",  # tensor parallel: heads
                "tp_colwise: model.layers.0.self_attn.q_proj has 64 output features, not divisible by tp_size=3",
                "parallel.ep_size: 3 does not divide the 4 experts",  # expert parallel
                "parallel.ep_fsdp_modules: model.layers.0.mlp, model.layers.1.mlp hold non-expert parameters",
                "attention_dropout: 0.25 is not supported with context parallel"]  # context parallel
    for text in expected:
        assert any(text in p for p in problems), (text, problems)
    with pytest.raises(UsageError) as err:
        check_built_model(model, layout)
    assert err.value.messages == problems


def test_a_layout_the_model_allows_has_no_problem():
    from fsdp2_backend.parallel.model_checks import built_model_problems

    layout = _layout(tp_size=2, ep_size=2, cp_size=2, cp_type="ring")
    assert built_model_problems(_moe_model(), layout) == []


def test_stages_called_directly_raise_the_same_problem():
    """The stages keep their own check for direct callers, from the same function."""
    from fsdp2_backend.parallel.model_checks import built_model_problems
    from fsdp2_backend.parallel.expert_parallel import apply_expert_parallel
    from fsdp2_backend.usage_errors import UsageError

    layout = _layout(ep_size=2, ep_fsdp_modules=["model.layers.0.mlp.experts"])
    (problem,) = built_model_problems(_moe_model(), layout)
    assert "does not cover the expert modules model.layers.1.mlp.experts" in problem
    with pytest.raises(UsageError, match="does not cover the expert modules model.layers.1.mlp.experts"):
        apply_expert_parallel(_moe_model(), layout, ctx=None)
