#!/usr/bin/env python
"""Generates completions of prompts with a trained model (the native config's `inference` group).

    python tools/generate.py [CONFIG.yaml] [--group.field value ...] --prompt "text" [--prompt ...]
    torchrun --nproc_per_node N tools/generate.py ...    # every rank generates the same; rank 0 prints

`--model.model_name_or_path` is an HF model directory or a checkpoint directory of a training run (an
iter_* directory, or the save directory: its newest complete checkpoint). Given a training YAML, it generates from
the newest checkpoint in the YAML's `training.output_dir` (the trained model, not the base model the YAML starts
from), unless `--model.model_name_or_path` says otherwise. `--inference.max_new_tokens`
bounds each completion, `--inference.do_sample true` samples (seeded with `--training.seed`) instead of
greedy decoding. Given a fine-tuning YAML (stage sft with a dataset), each prompt is the user turn of the run's
chat template (`data.template`, as training rendered it) and the completion is the assistant's reply. Each
completion is printed after a `=== N ===` line (N: the prompt's number).
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional, Tuple

from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error


def parse_command_line(argv: List[str]) -> Tuple[object, List[str], bool]:
    """(Config from the YAML file and the `--group.field` overrides, prompts, whether a YAML file was given)."""
    from fsdp2_backend.config.loading import build_config, load_yaml, split_native_overrides

    overrides, rest = split_native_overrides(argv)
    prompts, config_files, errors = [], [], []
    i = 0
    while i < len(rest):
        token = rest[i]
        if token.startswith("--prompt="):
            prompts.append(token.split("=", 1)[1])
        elif token == "--prompt":
            if i + 1 == len(rest):
                errors.append("--prompt: no text follows — write --prompt \"TEXT\"")
            else:
                prompts.append(rest[i + 1])
                i += 1
        elif token.startswith("-"):
            errors.append(f"{token}: unknown argument — use --prompt TEXT and --group.field value "
                          f"(see python tools/generate.py --help)")
        else:
            config_files.append(token)
        i += 1
    if len(config_files) > 1:
        errors.append(f"{' '.join(config_files)}: more than one config file — give at most one YAML file")
    if errors:
        raise UsageError(errors)
    layers = [(config_files[0], load_yaml(config_files[0]))] if config_files else []
    config = build_config(layers + [("command line", overrides)])
    if config_files and "model_name_or_path" not in overrides.get("model", {}):
        config = _from_the_runs_checkpoints(config)
    return config, prompts, bool(config_files)


def _from_the_runs_checkpoints(config):
    """A training YAML names the base model in model_name_or_path and the run's checkpoints in output_dir: generate
    from the newest of those (said on stderr), from the base model only while there are none."""
    import dataclasses

    from fsdp2_backend.checkpoint.dirs import resolve_checkpoint

    output_dir = config.training.output_dir
    checkpoint = resolve_checkpoint(output_dir) if output_dir else None
    if checkpoint is None:
        if output_dir and int(os.environ.get("RANK", "0")) == 0:
            print(f"notice: training.output_dir {output_dir} holds no checkpoint yet: generating from "
                  f"model.model_name_or_path {config.model.model_name_or_path} (the base model)", file=sys.stderr)
        return config
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"notice: generating from {checkpoint}, the newest checkpoint of training.output_dir (give "
              f"--model.model_name_or_path to choose another model)", file=sys.stderr)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, model_name_or_path=str(checkpoint)))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    with exit_on_usage_error():
        config, prompts, from_yaml = parse_command_line(argv)
        from fsdp2_backend.inference import generate

        # a fine-tuning YAML: the prompts go in as the user turn of the template the model was trained with
        chat = (from_yaml and config.training.stage == "sft" and config.data.data_manager_type == "lf"
                and config.data.dataset is not None)
        completions = generate(config, prompts, chat=chat)
    if int(os.environ.get("RANK", "0")) == 0:
        for number, completion in enumerate(completions, 1):
            print(f"=== {number} ===")
            print(completion, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
