"""Glob plans: which submodules a parallel stage applies to, named by patterns over module paths.

A pattern matches a module's dotted name (as in `model.named_modules()`) as a whole:
- `{}` or `{*}` stands for exactly one path component, e.g. `model.layers.{}` is every decoder layer;
- `*` stands for any run of characters, dots included, e.g. `*.q_proj` is every q_proj anywhere;
- everything else is literal (`model.embed_tokens`, `lm_head`; `?` and `[...]` too, unlike fnmatch).

A model may declare `plan_path_aliases` ({old component: new component}): a path component its checkpoints or
older configs name differently, e.g. MiniMax-M2's `block_sparse_moe` (MindSpeed-LLM f88dd26d's YAMLs, the HF
checkpoint) that transformers 5 calls `mlp`. A pattern naming the old component matches the module under the new.

This is the one matcher for module names: every stage that picks modules by pattern (tensor parallel, expert
parallel, recompute, FSDP) asks this module, so a pattern means the same thing in every plan field.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable, List, Sequence, Tuple

from torch import nn

from fsdp2_backend.usage_errors import UsageError


@lru_cache(maxsize=None)
def compile_pattern(pattern: str) -> "re.Pattern[str]":
    """The regex for one plan pattern (anchored at both ends)."""
    parts = re.split(r"(\{\*?\}|\*)", pattern)
    regex = []
    for part in parts:
        if part in ("{}", "{*}"):
            regex.append(r"[^.]+")
        elif part == "*":
            regex.append(r".*")
        else:
            regex.append(re.escape(part))
    return re.compile("".join(regex) + r"\Z")


def matches(name: str, patterns: Iterable[str]) -> bool:
    """True when `name` matches any of `patterns`."""
    return any(compile_pattern(p).match(name) for p in patterns)


def _with_aliases(model: nn.Module, pattern: str) -> List[str]:
    """`pattern` and, for each of the model's `plan_path_aliases` it names as a component, its new spelling."""
    aliases = getattr(model, "plan_path_aliases", None) or {}
    parts = pattern.split(".")
    renamed = [aliases.get(part, part) for part in parts]
    return [pattern] if renamed == parts else [pattern, ".".join(renamed)]


def match_modules(model: nn.Module, patterns: Sequence[str]) -> List[Tuple[str, nn.Module]]:
    """(name, module) for every submodule matching a pattern, in the model's registration order."""
    expanded = [q for p in patterns for q in _with_aliases(model, p)]
    return [(name, module) for name, module in model.named_modules() if name and matches(name, expanded)]


def unmatched_patterns(model: nn.Module, patterns: Sequence[str]) -> List[str]:
    """The patterns (in the given order) that match no submodule of `model`."""
    names = [name for name, _ in model.named_modules() if name]
    return [p for p in patterns
            if not any(compile_pattern(q).match(n) for q in _with_aliases(model, p) for n in names)]


def require_matches(model: nn.Module, patterns: Sequence[str], field: str) -> List[Tuple[str, nn.Module]]:
    """Like `match_modules`, but a pattern that matches nothing is a usage error naming `field`."""
    unmatched = unmatched_patterns(model, patterns)
    if unmatched:
        raise UsageError([f"{field}: pattern '{p}' matches no module of {type(model).__name__} — use module "
                          f"paths such as 'model.layers.{{*}}' or '*.q_proj'" for p in unmatched])
    return match_modules(model, patterns)


def lenient_matches(model: nn.Module, patterns: Sequence[str], field: str,
                    require_one: bool = True) -> List[Tuple[str, nn.Module]]:
    """Like `match_modules`, with one warning line (rank 0) per pattern that matches nothing: for plan fields a
    config may share across models (MindSpeed's YAMLs list modules some models lack), where a pattern with no
    module is harmless. With `require_one`, at least one pattern must match (the stage needs a module)."""
    unmatched = unmatched_patterns(model, patterns)
    if require_one and unmatched and len(unmatched) == len(patterns):
        return require_matches(model, patterns, field)
    if unmatched:
        from fsdp2_backend.distributed.console import print_rank0

        for pattern in unmatched:
            print_rank0(f"warning: {field}: pattern '{pattern}' matches no module of {type(model).__name__} — "
                        f"skipped")
    return match_modules(model, patterns)

