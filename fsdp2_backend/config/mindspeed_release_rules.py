"""MindSpeed-LLM's release v26.1.0 (branch and tag 26.1.0, what most users install) against its master (c77308a1):
the fields the two read differently, resolved once before the other rules, each with one line saying which
reading this run takes. Torch-free; called first by `validation`.

Found by diffing the two versions' argument classes (`mindspeed_llm/fsdp2/utils/arguments.py`) and YAMLs
(tests/data/mindspeed_fsdp2/v26.1.0 against head/ and head_newer_ids/). Both parsers skip a field they do not
know (argparse `parse_known_args`, an info line), and refuse a value outside a field's choices.
- `model.model_id: longcat_flash` is the release's name of LongCat-Flash-Lite (master: `longcat_flash_ngram`);
  resolved through the schema's one alias table (`MODEL_ID_ALIASES`).
- `optimization.indexer_loss_coeff` is the release's spelling of the DSA indexer's KL-loss weight (master moved it
  to `training.indexer_loss_coeff` and skips the old one, so a release YAML's 0.1 becomes master's default 1.0).
  Applied here; both spellings with different values are refused.
- Master's fields the release lacks (its parser skips them; listed in MASTER_ONLY) and master's values the release's
  choices refuse (`deepseek_v4`, `kvallgather`, `fused_adamw`): read as master reads them, said in one line.
- Unset, `training.deterministic` takes master's default (on); the release has no such switch. Not said: a YAML
  that does not set it cannot tell which version it was written for.
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Set, Tuple

from fsdp2_backend.config.schema import MODEL_ID_ALIASES, Config
from fsdp2_backend.models.registry import specs

RELEASE, MASTER = "MindSpeed-LLM v26.1.0", "MindSpeed-LLM master"
MASTER_ONLY = (  # master's argument-class fields that v26.1.0 has not: (group, field)
    ("parallel", "hook_modules"), ("parallel", "fsdp_implementation"), ("parallel", "enable_chunk_batch"),
    ("parallel", "chunk_mbs"), ("parallel", "chunk_mbs_batch_dim"), ("parallel", "chunk_mbs_modules"),
    ("parallel", "chunk_mbs_arg_indexs"), ("parallel", "chunk_mbs_kwarg_names"), ("training", "deterministic"),
    ("training", "indexer_loss_coeff"), ("training", "router_aux_loss_coef"), ("training", "mtp_loss_scaling_factor"),
    ("optimization", "use_ascend_mhc"), ("optimization", "use_triton_swiglu_limit"))
MASTER_ONLY_VALUES = (*(("model", "model_id", spec.model_id) for spec in specs() if spec.mindspeed_master_only),
                      ("parallel", "cp_type", "kvallgather"), ("training", "optimizer", "fused_adamw"))
INDEXER_DEFAULT = 1.0  # MindSpeed's default weight of the indexer's KL loss (both versions)


def release_readings(config: Config, native_fields: Optional[Set[Tuple[str, str]]] = None
                     ) -> Tuple[Config, List[str], List[str]]:
    """(the config with the release's spellings resolved, errors, notices): each difference said once.
    `native_fields`: the (group, field) pairs a YAML or ``--group.field`` set — a master-only field that a
    Megatron flag (or its default) set concerns no MindSpeed version and is not said; None: every field."""
    errors: List[str] = []
    notices: List[str] = []
    model, training = config.model, config.training
    if model.model_id in MODEL_ID_ALIASES:
        model_id, whose = MODEL_ID_ALIASES[model.model_id]
        notices.append(f"model.model_id: {model.model_id} is {whose} of {model_id} (MindSpeed-LLM master's) — this "
                       f"run builds {model_id}")
        model = replace(model, model_id=model_id)
    release_coeff, master_coeff = config.optimization.indexer_loss_coeff, training.indexer_loss_coeff
    if release_coeff is not None and master_coeff is not None and release_coeff != master_coeff:
        errors.append(f"optimization.indexer_loss_coeff: {release_coeff} ({RELEASE}'s spelling) and "
                      f"training.indexer_loss_coeff {master_coeff} ({MASTER}'s) name the same weight of the DSA "
                      f"indexer's KL loss — give one")
    elif release_coeff is not None:
        notices.append(f"optimization.indexer_loss_coeff: {release_coeff} weighs the DSA indexer's KL loss — "
                       f"{RELEASE} applies this spelling, {MASTER} ignores it (reads training.indexer_loss_coeff, "
                       f"default {INDEXER_DEFAULT}); this run applies it, as the release does")
    coeff = next(c for c in (master_coeff, release_coeff, INDEXER_DEFAULT) if c is not None)
    training = replace(training, indexer_loss_coeff=coeff)
    optimization = replace(config.optimization, indexer_loss_coeff=None)  # resolved: a second validation is silent
    master_only = _master_only_set(config, native_fields)
    if master_only:
        notices.append(f"{', '.join(master_only)}: read as {MASTER} reads them — {RELEASE} has no such field or "
                       f"value (its parser skips the fields and refuses the values)")
    return replace(config, model=model, training=training, optimization=optimization), errors, notices


def _master_only_set(config: Config, native_fields: Optional[Set[Tuple[str, str]]]) -> List[str]:
    """The master-only fields set to other than their defaults, and the master-only values chosen (by a native
    layer, where `native_fields` says which fields those set)."""
    defaults = Config()
    native = (lambda group, name: True) if native_fields is None else (  # noqa: E731
        lambda group, name: (group, name) in native_fields)
    named = [f"{group}.{name}" for group, name in MASTER_ONLY
             if getattr(getattr(config, group), name) != getattr(getattr(defaults, group), name) and native(group, name)]
    named += [f"{group}.{name}: {value}" for group, name, value in MASTER_ONLY_VALUES
              if getattr(getattr(config, group), name) == value and native(group, name)]
    return named
