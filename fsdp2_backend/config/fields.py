"""`help_field`: a dataclass field carrying its help text (the schema's one way of declaring a field; the docs
and `--help` read the text from its metadata). Torch-free."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def help_field(default: Any, help: str, **kw):
    """A dataclass field with its help text; list and dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})
