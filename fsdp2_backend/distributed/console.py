"""Rank-aware output, at the bottom of the house so every layer can print without importing the runtime:
`print_line` (one line in one write) and `print_rank0` (user-facing lines on rank 0, as Megatron's print_rank_0)."""
from __future__ import annotations


def print_line(line: str) -> None:
    """One line on stdout in ONE write: rank 0 (checkpoint lines) and the last rank (the training log line)
    share torchrun's output, and `print` under `python -u` writes the text and its newline separately, so
    another rank's line could land between them and glue two lines together."""
    import sys

    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def print_rank0(line: str) -> None:
    """User-facing lines (Megatron's among them), on stdout of rank 0 as print_rank_0 writes."""
    import torch.distributed as dist  # here, not at import: validation reads this module without torch

    if not dist.is_initialized() or dist.get_rank() == 0:
        print_line(line)
