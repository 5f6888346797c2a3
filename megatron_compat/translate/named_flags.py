"""Validation messages about native fields, naming the Megatron flags the user typed that set those fields.

The config rules speak in native fields (`model.quant_recipe_name: ...`); a user who typed `--fp8-recipe` must
see that flag too. The translation records, per field, every flag that determined it (`Translation.field_flags`);
`name_flags` adds them after each field a message names: the field the message is about (its head) and the
fields its advice names (`use parallel.tp_size 1`). Fields no flag set (Megatron's defaults, the YAML) and flags
the message names already are left as they are.
"""
from __future__ import annotations

import re
from typing import Dict, List, Sequence

_FIELD = re.compile(r"\b(?:model|data|parallel|training|profiling|inference|optimization)\.[A-Za-z0-9_.]*[A-Za-z0-9_]")


def _flags_of(name: str, field_flags: Dict[str, List[str]]) -> List[str]:
    """The flags of `name` or, for a key inside a field (model.architecture.vocab_size), of the nearest field."""
    while name:
        if field_flags.get(name):
            return field_flags[name]
        if name.count(".") < 2:  # a group's field: no parent field to fall back to
            return []
        name = name.rsplit(".", 1)[0]
    return []


def name_flags(messages: Sequence[str], field_flags: Dict[str, List[str]]) -> List[str]:
    """Each message with `(from --flag, ...)` after the first mention of every field a flag set."""
    out = []
    for message in messages:
        seen = set()

        def annotate(match: re.Match) -> str:
            name = match.group(0)
            flags = [f for f in _flags_of(name, field_flags) if not re.search(re.escape(f) + r"\b", message)]
            if not flags or name in seen:  # none set it, or the message names them already
                return name
            seen.add(name)
            return f"{name} (from {', '.join(flags)})"
        out.append(_FIELD.sub(annotate, message))
    return out
