"""The one exception type for bad user input, and how it reaches the user.

Anything a user can get wrong (a flag, a field, a file) raises `UsageError` with one or more messages of the
form `<field or flag or file>: <what is wrong> — <what to do>`. Entry points call `exit_on_usage_error`, which
prints each as `error: ...` on stderr and exits with code 2, never a traceback.
"""
from __future__ import annotations

import os
import time
import sys
from contextlib import contextmanager
from typing import Iterable, Iterator

USAGE_EXIT_CODE = 2
RUN_STOPPED_EXIT_CODE = 1


class UsageError(Exception):
    """Bad user input; carries every problem found, one message each."""

    def __init__(self, messages: str | Iterable[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class RunStopped(Exception):
    """A run that cannot go on for a reason outside the command line (a NaN loss, a full disk): reported the same
    way, one `error:` line per message and no traceback, with exit code 1."""

    def __init__(self, messages: str | Iterable[str]):
        self.messages = [messages] if isinstance(messages, str) else list(messages)
        super().__init__("\n".join(self.messages))


class RunInterrupted(Exception):
    """Ctrl-C (SIGINT; torchrun hands it to every worker): one line on rank 0 saying where the run stood and how to
    go on — no `error:` prefix, nothing is wrong — and exit code 130 (128 + SIGINT, as a shell reports it)."""

    def __init__(self, message: str):
        self.messages = [message]
        super().__init__(message)


INTERRUPTED_EXIT_CODE = 130
USAGE_EXIT_GRACE_S = 5.0


def report_and_exit(messages: Iterable[str], code: int = USAGE_EXIT_CODE) -> None:
    """Prints `error: <message>` lines on stderr and exits with code 2. Under torchrun every rank meets the same
    input, so only rank 0 prints: the user reads each problem once."""
    if os.environ.get("RANK", "0") == "0":
        for message in messages:
            print(f"error: {message}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops the other workers as soon as one exits: a rank leaving first could take rank 0 down
        # before its line is out (the user would see no error at all). The others leave a moment later.
        time.sleep(USAGE_EXIT_GRACE_S)
    sys.stderr.flush()
    raise SystemExit(code)


@contextmanager
def exit_on_usage_error() -> Iterator[None]:
    """Turns a UsageError raised inside the block into `error:` lines and exit code 2 (a RunStopped: exit 1; Ctrl-C:
    one line and exit 130)."""
    try:
        yield
    except UsageError as exc:
        report_and_exit(exc.messages)
    except RunStopped as exc:
        report_and_exit(exc.messages, RUN_STOPPED_EXIT_CODE)
    except (RunInterrupted, KeyboardInterrupt) as exc:  # before training started (or in a tool): no iteration to name
        message = exc.messages[0] if isinstance(exc, RunInterrupted) else "interrupted"
        if os.environ.get("RANK", "0") == "0":
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_EXIT_CODE) from None
