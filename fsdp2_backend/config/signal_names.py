"""What a signal name means (`training.exit_signal`, Megatron's --exit-signal): `SIGTERM`, `TERM`, `sigusr1` or a
number → the signal. Torch-free, read by validation (an exit_signal that names no signal) and by the handler
(`training/exit_signal.py`) alike."""
from __future__ import annotations

import signal
from typing import Optional


def resolve_signal(name: str) -> Optional[signal.Signals]:
    """`SIGTERM`, `TERM`, `sigusr1` or a number such as `15` → the signal; None when no such signal exists."""
    text = str(name).strip()
    try:
        return signal.Signals(int(text))
    except ValueError:
        pass
    except Exception:  # a number that is no signal
        return None
    key = text.upper()
    key = key if key.startswith("SIG") else "SIG" + key
    return signal.Signals.__members__.get(key)
