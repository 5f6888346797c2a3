"""The entry point and its tools run as users run them (torchrun subprocesses)."""
