"""The command line of `pretrain_fsdp2.py`: native YAML, `--group.field` overrides and Megatron flags, mixed.

    pretrain_fsdp2.py [CONFIG.yaml] [--group.field VALUE ...] [Megatron/MindSpeed flags ...] [--dry-run]

Layers, in order: the YAML file, the Megatron translation, the `--group.field` overrides (which may override
the YAML). A field set both by a Megatron flag and natively to different values is an error naming both.
`--dry-run` validates against WORLD_SIZE (unset: the smallest world the layout fits) and prints the config as YAML (the flag report as YAML
comments, so the whole output loads back, then the memory estimate); it checks that the model, tokenizer and
data files are there and open (a truncated .idx/.bin), loading none of them and touching no device.
`-h` / `--help` prints a short usage, `--help-flags` every Megatron flag,
`--help-config` every native field; no arguments at all is the usage line and exit code 2.
"""
from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from fsdp2_backend.config import Config
from fsdp2_backend.config.loading import build_config, load_yaml, split_native_overrides, to_yaml
from fsdp2_backend.config.validation import validate_with_notices
from fsdp2_backend.config.rules.input_files import input_file_errors
from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error

DRY_RUN_FLAG = "--dry-run"
HELP_FLAGS_FLAG, HELP_CONFIG_FLAG = "--help-flags", "--help-config"

USAGE_LINE = ("usage: [torchrun --nproc_per_node N] pretrain_fsdp2.py [CONFIG.yaml] [--group.field VALUE ...] "
              "[Megatron/MindSpeed flags ...] [--dry-run]")
USAGE = f"""{USAGE_LINE}

Trains a model with Megatron-LM / MindSpeed-LLM flags (as pretrain_gpt.py takes them), a native YAML config, or both.

  CONFIG.yaml           a native config: groups model, data, parallel, training, ... (docs/config_reference.md)
  --group.field VALUE   sets one native field, e.g. --training.lr 3e-4 --parallel.tp_size 2 (overrides the YAML)
  Megatron flags        e.g. --num-layers 24 --hidden-size 1024 --data-path ... --save DIR (docs/migration_table.md);
                        each is mapped, accepted without effect (listed at start) or declined with the reason
  --dry-run             checks everything (the model, tokenizer and data files exist; nothing is loaded, no device is
                        touched) and prints the config as YAML, the flag report and the memory estimate as comments
                        (WORLD_SIZE=N checks an N-rank layout)
  --help-flags          lists every Megatron-LM / MindSpeed-LLM flag this parser knows
  --help-config         lists every native field with its default

examples:
  WORLD_SIZE=8 python pretrain_fsdp2.py <Megatron flags> --dry-run > run.yaml
  torchrun --nproc_per_node 8 pretrain_fsdp2.py run.yaml --training.max_steps 2000
"""


def _help(argv: List[str]) -> Optional[str]:
    """The text asked for by -h / --help (the short usage), --help-flags or --help-config; None otherwise."""
    if HELP_FLAGS_FLAG in argv:
        from megatron_compat.parse.arguments import build_parser

        return build_parser().format_help()
    if HELP_CONFIG_FLAG in argv:
        from fsdp2_backend.config.loading import field_help

        return "".join(f"--{group}.{name} ({kind}, default {default!r}): {text}\n"
                       for group, name, kind, default, text in field_help())
    if "-h" in argv or "--help" in argv:
        return USAGE
    return None


def _conflicts(explicit: Dict[str, Dict[str, Any]], native: List[Tuple[str, Dict[str, Dict[str, Any]]]],
               sources: Dict[str, str]) -> List[str]:
    """Fields set by a Megatron flag and natively to a different value."""
    probe = build_config([("Megatron flags", explicit)])
    errors = []
    for origin, groups in native:
        single = build_config([(origin, groups)])
        for group, values in groups.items():
            for name in values:
                if name not in explicit.get(group, {}):
                    continue
                ours, theirs = getattr(getattr(probe, group), name), getattr(getattr(single, group), name)
                if ours != theirs:
                    errors.append(f"{group}.{name}: set two different ways — {sources[f'{group}.{name}']} gives "
                                  f"{ours!r}, {origin} gives {theirs!r}; keep one")
    return errors


def _split_by_source(translation) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Dict[str, Any]]]:
    """(Megatron's defaults, fields set by a flag the script gives): native settings override the former."""
    defaults: Dict[str, Dict[str, Any]] = {}
    explicit: Dict[str, Dict[str, Any]] = {}
    for group, values in translation.fields.items():
        for name, value in values.items():
            by_flag = translation.sources.get(f"{group}.{name}", "").startswith("-")
            (explicit if by_flag else defaults).setdefault(group, {})[name] = value
    return defaults, explicit


def minimal_world_size(config: Config) -> int:
    """The smallest world the config's parallel sizes fit: used by --dry-run when WORLD_SIZE is not set."""
    p = config.parallel
    sizes = [p.tp_size * p.cp_size, max(p.fsdp_size, 1), p.ep_size * p.ep_fsdp_size]
    return functools.reduce(math.lcm, [max(s, 1) for s in sizes])


def parse_command_line(argv: List[str], world_size: Optional[int],
                       check_files: bool = False) -> Tuple[Config, List[str]]:
    """argv → validated Config and the report lines (Megatron translation, world size used) for the user."""
    config, report, _ = parse_for_world(argv, world_size, check_files)
    return config, report


def parse_for_world(argv: List[str], world_size: Optional[int],
                    check_files: bool = False) -> Tuple[Config, List[str], int]:
    """`parse_command_line`, also returning the world size it validated for.

    `world_size` None (a dry run without WORLD_SIZE) validates for the smallest world the layout fits.
    `check_files`: also check the input files (model and data; `config.rules.input_files`), reported with the other
    problems — a run and a dry run do (they are looked at, not loaded).
    """
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

        model_given = any(groups.get("model", {}).get(name) for _, groups in native
                          for name in ("model_name_or_path", "architecture"))
        translation = translate_megatron(rest, world_size=world_size, model_given=bool(model_given))
        report = report_lines(translation.report)
        defaults, explicit = _split_by_source(translation)
        errors = _conflicts(explicit, native, translation.sources)
        if errors:
            raise UsageError(errors)
        layers = [("Megatron defaults", defaults)] + native[:1] + [("Megatron flags", explicit)] + native[1:]
    config = build_config(layers)
    if world_size is None:  # the line's own smallest world (distributed-optimizer instances) counts too
        world_size = math.lcm(minimal_world_size(config), translation.world_size if rest else 1)
        report.append(f"validated for world size {world_size} (the smallest this layout fits; set WORLD_SIZE "
                      f"to check another)")
    file_errors = input_file_errors(config) if check_files else []
    try:
        native_fields = {(group, name) for _, groups in native for group, values in groups.items()
                         if isinstance(values, dict) for name in values}
        config, notices = validate_with_notices(config, world_size, native_fields)
    except UsageError as exc:  # one report: a missing model directory is said once, as such
        missing_model = any(e.startswith("model.model_name_or_path") for e in file_errors)
        messages = [m for m in exc.messages if not (missing_model and m.startswith("model.model_name_or_path"))]
        raise UsageError(_named(file_errors + messages, translation if rest else None)) from None
    if file_errors:
        raise UsageError(_named(file_errors, translation if rest else None))
    return config, report + [f"notice: {line}" for line in notices], world_size


def _set_fields(config: Config) -> str:
    """The fields whose value is not the default, as commented YAML: what a user reads first in a dry run (a
    Megatron line sets ~40 of ~360 fields; the full config, loadable as it is, follows)."""
    import yaml

    defaults, values = Config().to_dict(), config.to_dict()
    changed = {group: {k: v for k, v in fields_.items() if v != defaults[group][k]}
               for group, fields_ in values.items()}
    changed = {group: fields_ for group, fields_ in changed.items() if fields_}
    count, total = sum(map(len, changed.values())), sum(map(len, values.values()))
    text = yaml.safe_dump(changed, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return (f"# the {count} fields (of {total}) not at their default; the full config, every default filled in, "
            f"follows:\n" + "".join(f"#   {line}\n" for line in text.splitlines()))


def _named(messages: List[str], translation) -> List[str]:
    """Messages about fields a Megatron flag set also name the flags the user typed."""
    if translation is None:
        return messages
    from megatron_compat.translate.named_flags import name_flags

    return name_flags(messages, translation.field_flags)


def compact_report(report: List[str]) -> List[str]:
    """The report a run prints at start: the mapped flags as one count (a script maps dozens; `--dry-run` lists
    each with its field), then every line that asks for attention (no effect, declined, warnings, notices)."""
    mapped = [line for line in report if line.startswith("mapped: ")]
    head = [f"Megatron flags: {len(mapped)} mapped to native fields (--dry-run lists each with its field)"]
    return (head if mapped else []) + [line for line in report if not line.startswith("mapped: ")]


def _memory_estimate(config: Config, world: int, dry_run: bool) -> str:
    """The memory estimate's line (config/memory_estimate.py), before anything is built; a run that cannot fit
    is refused (UsageError). A dry run only prints it (it may run elsewhere than the job). An estimate that cannot
    be made (the model's config is not there yet) checks nothing: the build says what is wrong."""
    from fsdp2_backend.config.memory_estimate import estimate_memory, fit_errors

    try:
        estimate = estimate_memory(config, world)
    except (ValueError, TypeError, OSError, ZeroDivisionError) as exc:  # the build reports a model it cannot read
        return f"memory estimate: not made ({exc})"
    if not dry_run:
        errors = fit_errors(estimate, world)
        if errors:
            raise UsageError(errors)
    return estimate.line()


def world_size_from_env(default: Optional[int] = 1) -> Optional[int]:
    if "WORLD_SIZE" not in os.environ:
        return default
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise UsageError(f"WORLD_SIZE: not an integer ({os.environ['WORLD_SIZE']!r}) — unset it or fix it") from None


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = _help(argv)
    if text is not None:
        if os.environ.get("RANK", "0") == "0":
            sys.stdout.write(text)
        return 0
    if not argv:
        if os.environ.get("RANK", "0") == "0":
            print(f"{USAGE_LINE}\nerror: no arguments — give a YAML config, Megatron flags or both "
                  f"(pretrain_fsdp2.py --help)", file=sys.stderr)
        return 2
    with exit_on_usage_error():
        dry_run = DRY_RUN_FLAG in argv
        config, report, world = parse_for_world(argv, world_size_from_env(None if dry_run else 1), True)
    with exit_on_usage_error():
        memory = _memory_estimate(config, world, dry_run)
    if dry_run:
        sys.stdout.write(f"# pretrain_fsdp2.py --dry-run for WORLD_SIZE={world}: this file runs as it is at that world "
                         f"size only (the batch split and the layout were derived for it) — for another, rerun "
                         f"--dry-run with that WORLD_SIZE\n")
        sys.stdout.write(_set_fields(config))
        sys.stdout.write(to_yaml(config))
        for line in report:
            sys.stdout.write(f"# {line}\n")
        sys.stdout.write(f"# {memory}\n")
        return 0
    if os.environ.get("RANK", "0") == "0":  # one report per job, not one per rank
        for line in compact_report(report):
            print(line, file=sys.stderr)
    if config.training.exit_signal_handler:
        # before the data loader forks its workers: they inherit the handler and survive a signal to the tree
        from fsdp2_backend.training.exit_signal import install

        install(config.training.exit_signal)
    from fsdp2_backend.build import run_training  # torchao's import noise: filtered by fsdp2_backend.known_noise

    with exit_on_usage_error():  # also a RunStopped (NaN loss, full disk): one line, exit code 1
        run_training(config)
    return 0
