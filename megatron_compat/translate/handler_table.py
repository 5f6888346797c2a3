"""The table of flag handlers (`HANDLERS`: dest → (target field, handler)) and the two ways to fill it: `handles`
(a decorator) and `_direct` (a one-to-one field). The handler modules (`handlers.py` and the topic modules it
loads: batch_optim, memory_layout, mup, recompute, tokenizer_data) register here, so none imports another."""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

HANDLERS: Dict[str, Tuple[str, Callable]] = {}


def handles(dest: str, target: str):
    """Registers a handler for one dest."""
    def register(fn):
        HANDLERS[dest] = (target, fn)
        return fn
    return register


def _direct(dest: str, target: str, convert: Callable[[Any], Any] = lambda v: v, when_none: bool = False) -> None:
    def handler(ctx, value):
        if value is not None or when_none:
            ctx.set(target, convert(value))
    HANDLERS[dest] = (target, handler)
