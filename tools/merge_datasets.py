#!/usr/bin/env python
"""Megatron-LM's `tools/merge_datasets.py`: the same flags, the same output bytes.

The code is fsdp2_backend/cli/merge_datasets.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.merge_datasets", run_name="__main__", alter_sys=True)
