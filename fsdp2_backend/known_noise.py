"""Import-time lines that say nothing to a user, silenced once for every entry point and tool (the package's
`__init__` installs the filters before anything imports transformers). Each filter drops one known message only;
everything else from the same logger still shows.

- torchao (the `quant` extra), which transformers imports with any model when it is installed: "Failed to load
  …/torchao/_C_*.so" for its CUDA-only extensions, on a machine without CUDA (where they cannot load, and nothing
  here calls them).
- torch's pytree: "<enum …> is an Enum subclass and is now natively supported by torch.compile …" — a deprecation
  note about torchao's own `register_constant` calls, not about this project's code.
- torch's DTensor redistribution: "While redistributing from (_StridedShard…, Shard…) to (Replicate(), Replicate()),
  2 sequential all_gather operations will be performed. This is suboptimal … may give inconsistent results between
  ranks due to different reduction orders", once per rank at every HF export under TP (the export gathers each
  weight whole). All-gathers copy bytes and reduce nothing: the ranks get the same values; the note about
  reduction orders does not apply, and the cost is the export's own. Redistributions that reduce still show.
Torch-free at install time: the filters look at torch only when a record arrives (torch is loaded by then).
"""
from __future__ import annotations

import logging
import sys


class _TorchaoExtensionFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not (message.startswith("Failed to load") and ".so" in message and "torchao" in message):
            return True
        torch = sys.modules.get("torch")
        return bool(torch is not None and torch.cuda.is_available())  # with CUDA the failure may matter


class _PytreeEnumFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


class _SequentialAllGatherFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("While redistributing from") and "to (Replicate()" in message
                    and "all_gather operations will be performed" in message)


def install() -> None:
    """Adds the filters (idempotent)."""
    for name, kind in (("torchao", _TorchaoExtensionFilter), ("torch.utils._pytree", _PytreeEnumFilter),
                       ("torch.distributed.tensor._redistribute", _SequentialAllGatherFilter)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
