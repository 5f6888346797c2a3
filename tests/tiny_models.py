"""A tiny HF config for every model id of the registry (fsdp2_backend/models/registry.py), for tests that must
cover them all. Each comes from the model's own test module, so one definition serves both."""
from __future__ import annotations


def _qwen3():
    from tests.helpers import tiny_qwen3_config
    return tiny_qwen3_config()


def _qwen3_moe():
    from tests.models.test_qwen3_moe import tiny_moe_config
    return tiny_moe_config()


def _qwen3_next():
    from tests.models.test_qwen3_next import tiny_next_config
    return tiny_next_config()


def _mamba3():
    from tests.models.test_mamba3_model import tiny_config
    return tiny_config()


def _gpt_oss():
    from tests.models.test_gpt_oss import tiny_gpt_oss_config
    return tiny_gpt_oss_config()


def _minimax():
    from tests.models.test_minimax_m2 import tiny_minimax_config
    return tiny_minimax_config()


def _step35():
    from tests.models.test_step35 import step35_config
    return step35_config()


def _family(name):
    def build():
        from tests.models.test_router_families import _config
        return _config(name)
    return build


def _newer(name):
    def build():
        from tests.models.test_newer_model_ids import tiny_config
        return tiny_config(name)
    return build


TINY_CONFIGS = {"qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next, "mamba3": _mamba3,
                "gpt_oss": _gpt_oss, "minimax_m27": _minimax, "step35": _step35,
                **{name: _family(name) for name in ("deepseek_v3", "mixtral", "qwen2_moe")},
                **{name: _newer(name) for name in ("deepseek_v4", "glm52", "longcat_flash_ngram")}}
