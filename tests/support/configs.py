"""Config builders for the validation tests: a pretraining config from group values (`pt_config`), and the messages
validation refuses it with (`messages`)."""
from __future__ import annotations

import pytest

from fsdp2_backend.config.loading import build_config
from fsdp2_backend.config.validation import validate
from fsdp2_backend.usage_errors import UsageError


def pt_config(**groups):
    base = {"model": {"model_name_or_path": "/m"}, "data": {"dataset": "/d", "data_manager_type": "mg"},
            "training": {"output_dir": "/o", "stage": "pt", "max_steps": 4}}
    for group, values in groups.items():
        base.setdefault(group, {}).update(values)
    return build_config([("test", base)])


def messages(config, world_size=1):
    with pytest.raises(UsageError) as info:
        validate(config, world_size)
    return info.value.messages
