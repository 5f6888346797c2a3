"""The command line of `pretrain_fsdp2.py`: native YAML, `--group.field` overrides and Megatron flags, mixed.

    pretrain_fsdp2.py [CONFIG.yaml] [--group.field VALUE ...] [Megatron/MindSpeed flags ...] [--dry-run]

Layers, in order: the YAML file, the Megatron translation, the `--group.field` overrides (which may override
the YAML). A field set both by a Megatron flag and natively to different values is an error naming both.
`--dry-run` validates against WORLD_SIZE (default 1) and prints the config as YAML (the flag report as YAML
comments, so the whole output loads back) without touching devices, data or model files. Torch is imported
only when training starts.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from fsdp2_backend.config import Config
from fsdp2_backend.config_loading import build_config, load_yaml, split_native_overrides, to_yaml
from fsdp2_backend.config_validation import validate
from fsdp2_backend.errors import UsageError, exit_on_usage_error

DRY_RUN_FLAG = "--dry-run"


def _conflicts(megatron: Dict[str, Dict[str, Any]], native: List[Tuple[str, Dict[str, Dict[str, Any]]]],
               flag_of: Dict[str, str]) -> List[str]:
    """Fields set by a Megatron flag and natively to a different value."""
    probe = build_config([("", megatron)])
    errors = []
    for origin, groups in native:
        single = build_config([(origin, groups)])
        for group, values in groups.items():
            for name in values:
                ours, theirs = getattr(getattr(probe, group), name), getattr(getattr(single, group), name)
                if name in megatron.get(group, {}) and ours != theirs:
                    flag = flag_of.get(f"{group}.{name}", "a Megatron flag")
                    errors.append(f"{group}.{name}: set two different ways — {flag} gives {ours!r}, {origin} gives "
                                  f"{theirs!r}; keep one")
    return errors


def parse_command_line(argv: List[str], world_size: int) -> Tuple[Config, List[str]]:
    """argv → validated Config and the report lines of the Megatron translation (empty without one)."""
    argv = [a for a in argv if a != DRY_RUN_FLAG]
    native: List[Tuple[str, Dict[str, Dict[str, Any]]]] = []
    if argv and not argv[0].startswith("-") and argv[0].endswith((".yaml", ".yml")):
        native.append((argv[0], load_yaml(argv[0])))
        argv = argv[1:]
    overrides, rest = split_native_overrides(argv)
    if overrides:
        native.append(("--group.field overrides", overrides))
    report: List[str] = []
    layers = list(native)
    if rest:
        from megatron_compat.translate import report_lines, translate_megatron

        translation = translate_megatron(rest, world_size=world_size)
        report = report_lines(translation.report)
        flag_of = {target: flag for flag, target in translation.report.mapped}
        errors = _conflicts(translation.fields, native, flag_of)
        if errors:
            raise UsageError(errors)
        layers = native[:1] + [("Megatron flags", translation.fields)] + native[1:]
    config = build_config(layers)
    return validate(config, world_size), report


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(f"WORLD_SIZE: not an integer ({os.environ['WORLD_SIZE']!r}) — unset it or fix it") from None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with exit_on_usage_error():
        config, report = parse_command_line(argv, world_size_from_env())
    if DRY_RUN_FLAG in argv:
        sys.stdout.write(to_yaml(config))
        for line in report:
            sys.stdout.write(f"# {line}\n")
        return 0
    for line in report:
        print(line, file=sys.stderr)
    from fsdp2_backend.training.trainer import run_training

    with exit_on_usage_error():
        run_training(config)
    return 0
