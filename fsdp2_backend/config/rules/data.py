"""Rules of the `data.*` fields: fill-in-the-middle, and the fine-tuning (SFT) data path. Torch-free; called once from
`validation`; its parts, in order:

Validation of the fill-in-the-middle fields (`data.fim_*`, Megatron-LM's `--fim-*` flags), torch-free.

Megatron-LM asserts that FIM has real data (no mock data) and rates; its dataset crashes later on a split token
without a fragment rate. Here each is one line, found with the other config problems. Whether the FIM tokens are
tokens of the tokenizer is checked when the dataset is built (the tokenizer is loaded then).

The rules of the fine-tuning stage (`training.stage: sft`, `data.data_manager_type: lf`), torch-free.

`check_sft(config, errors)` adds one message per problem; `sft_notices(config)` lists the fields that have no
effect on the SFT data path; `normalise_sft(config)` fills what SFT derives: the loss is the per-token mean over
the global batch's valid tokens (LLaMA-Factory's `num_items_in_batch` over gradient accumulation and data
parallel ranks), i.e. `calculate_per_token_loss` on.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from typing import List

from fsdp2_backend.usage_errors import UsageError


# --- fim -------------------------------------------------------------------------------------------

# megatron_compat.data.fim_dataset.FIM_TOKEN_ROLES, not imported: that module imports torch
FIM_TOKEN_ROLES = ("prefix", "middle", "suffix", "pad", "eod")


def fim_errors(config) -> List[str]:
    data = config.data
    if not data.fim_data:
        return []
    errors = []
    if data.mock_data:
        errors.append("data.fim_data (--fim-data): Megatron-LM has no FIM over mock data — give --data-path, or "
                      "drop --fim-data")
    if config.training.stage != "pt":
        errors.append("data.fim_data (--fim-data): FIM applies to pretraining data only — drop it for SFT")
    for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(data, name)
        if value is not None and not 0.0 <= value <= 1.0:
            errors.append(f"data.{name} (--{name.replace('_', '-')}): {value} is not a probability — give a "
                          "value in [0, 1]")
    if data.fim_split_sample and data.fim_fragment_rate is None:
        errors.append("data.fim_fragment_rate (--fim-fragment-rate): required with --fim-split-sample (Megatron-LM "
                      "fails on its first split fragment without it) — give a rate in [0, 1]")
    tokens = data.fim_tokens or {}
    missing = [role for role in FIM_TOKEN_ROLES if not tokens.get(role)]
    extra = sorted(set(tokens) - set(FIM_TOKEN_ROLES))
    if missing or extra:
        errors.append(f"data.fim_tokens: needs exactly the keys {', '.join(FIM_TOKEN_ROLES)} (missing: "
                      f"{', '.join(missing) or 'none'}; unknown: {', '.join(extra) or 'none'}) — name each token")
    return errors


# --- sft -------------------------------------------------------------------------------------------

SFT_TEMPLATES = ("qwen3", "gpt", "empty")
SFT_TOOL_FORMATS = ("qwen", "default")
EFFICIENT_EOS_TEMPLATES = ("gpt",)  # data/sft/template.py: efficient_eos
# Data fields only Megatron's pretraining data reads: with the SFT data path they have no effect.
MG_ONLY_DATA_FIELDS = ("split", "create_attention_mask_in_dataloader", "reset_attention_mask", "append_eod",
                       "data_cache_path", "mock_data", "eod_mask_loss", "reset_position_ids", "train_data_path",
                       "valid_data_path", "test_data_path", "dataloader_type")


def check_special_tokens(m, errors: List[str]) -> None:
    """`new_special_tokens_config` is a YAML mapping {token: description}; desc_init variants need it."""
    if m.init_special_tokens != "noise_init" and not m.new_special_tokens_config:
        errors.append(f"model.init_special_tokens: {m.init_special_tokens} initialises new tokens from their "
                      "descriptions — set model.new_special_tokens_config (a YAML {token: description})")
    if not m.new_special_tokens_config:
        return
    import os

    import yaml

    path = m.new_special_tokens_config
    try:
        with open(path, encoding="utf-8") as f:
            table = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        errors.append(f"model.new_special_tokens_config: cannot read {path} ({type(exc).__name__}) — give a YAML "
                      "file {'<token>': 'description'}")
        return
    if not isinstance(table, dict) or not table or not all(isinstance(v, str) for v in table.values()):
        errors.append(f"model.new_special_tokens_config: {os.path.basename(path)} is not a non-empty mapping "
                      "{'<token>': 'description'} — write one description per token")


def check_sft(config, errors: List[str]) -> None:
    d, t, m = config.data, config.training, config.model
    check_special_tokens(m, errors)
    if t.stage == "sft" and d.data_manager_type != "lf":
        errors.append("training.stage: sft reads the fine-tuning data path — set data.data_manager_type: lf (or "
                      "training.stage: pt for Megatron pretraining data)")
    if d.data_manager_type != "lf":
        return
    if t.stage == "pt":
        errors.append("data.data_manager_type: lf with training.stage pt (raw text pretraining through the "
                      "fine-tuning pipeline) is not built — set data.data_manager_type: mg, which tokenizes raw "
                      ".jsonl/.parquet files itself")
        return
    if importlib.util.find_spec("datasets") is None:
        errors.append("data.data_manager_type: lf reads its data with HF datasets, which is not installed — pip "
                      "install datasets (or megatron-fsdp2[sft])")
    if d.dataset is None:
        errors.append("data.dataset: fine-tuning needs a dataset — a name in dataset_dir/dataset_info.json or an "
                      "inline {file_name: FILE, formatting: alpaca|sharegpt|openai}")
    else:
        from fsdp2_backend.data.sft.loader import dataset_attrs

        for spec, name in ((d.dataset, "dataset"), (d.eval_dataset, "eval_dataset")):
            try:
                dataset_attrs(spec, d.dataset_dir, name)
            except UsageError as exc:
                errors.extend(str(exc).removeprefix("error: ").splitlines())
    if d.template is not None and d.template not in SFT_TEMPLATES:
        errors.append(f"data.template: '{d.template}' is not a template — use one of {', '.join(SFT_TEMPLATES)}, or "
                      "unset it for the tokenizer's own chat template")
    if d.train_on_prompt and d.template in EFFICIENT_EOS_TEMPLATES:
        errors.append(f"data.train_on_prompt: template {d.template} ends each sample with one eos (efficient_eos), "
                      "which cannot train on prompts (MindSpeed refuses it too) — unset train_on_prompt")
    if d.tool_format is not None and d.tool_format not in SFT_TOOL_FORMATS:
        errors.append(f"data.tool_format: '{d.tool_format}' is not a tool format — use one of "
                      f"{', '.join(SFT_TOOL_FORMATS)}")
    if d.cutoff_len < 2:
        errors.append(f"data.cutoff_len: {d.cutoff_len} leaves no room for a prompt and a reply — give at least 2")
    if d.streaming and t.max_steps <= 0:
        errors.append("training.max_steps: a streamed dataset has no known length, so epochs cannot be counted — "
                      "set max_steps")
    if d.streaming and d.buffer_size < 1:
        errors.append(f"data.buffer_size: must be at least 1, got {d.buffer_size}")
    if d.val_size and d.dataset is None:
        errors.append("data.val_size: splits the training data — set data.dataset")
    if d.eval_num_beams is not None:
        errors.append("data.eval_num_beams: generation-based evaluation (predict_with_generate) is not built; "
                      "evaluation reports the loss — unset it")
    if m.tokenizer_type:
        errors.append(f"model.tokenizer_type: {m.tokenizer_type} has no chat template; fine-tuning needs an HF "
                      "tokenizer — unset tokenizer_type and give tokenizer_name_or_path")
    if d.preprocessing_num_workers is not None and d.preprocessing_num_workers < 1:
        errors.append(f"data.preprocessing_num_workers: must be at least 1, got {d.preprocessing_num_workers}")
    if d.preprocessing_batch_size < 1:
        errors.append(f"data.preprocessing_batch_size: must be at least 1, got {d.preprocessing_batch_size}")


def sft_notices(config) -> List[str]:
    d, defaults = config.data, type(config.data)()
    tokens = (["model.add_special_tokens: no effect — model.new_special_tokens_config takes precedence (its tokens "
               "are added)"] if config.model.new_special_tokens_config and config.model.add_special_tokens else [])
    if d.data_manager_type != "lf":
        return tokens
    notices = tokens + [f"data.{name}: no effect on the fine-tuning data path (Megatron pretraining data only)"
               for name in MG_ONLY_DATA_FIELDS if getattr(d, name) != getattr(defaults, name)]
    if d.eval_on_each_dataset and not (d.val_size or d.eval_dataset):
        notices.append("data.eval_on_each_dataset: no effect without data.val_size or data.eval_dataset")
    if not d.streaming and d.buffer_size != defaults.buffer_size:
        notices.append("data.buffer_size: no effect without data.streaming")
    if (d.val_size or d.eval_dataset) and not config.training.eval_interval:
        notices.append("data.val_size / eval_dataset: evaluated at the end of training only (set "
                       "training.eval_interval to evaluate every N iterations too)")
    return notices


def normalise_sft(config):
    if config.data.data_manager_type == "lf" and config.training.stage == "sft":
        return replace(config, training=replace(config.training, calculate_per_token_loss=True))
    return config
