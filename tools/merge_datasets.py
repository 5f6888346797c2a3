#!/usr/bin/env python
"""Megatron-LM's `tools/merge_datasets.py`: the same flags, the same output bytes.

The code is fsdp2_backend/cli/merge_datasets.py; this script runs it, installed or not, as Megatron users expect.
"""
import os
import runpy
import sys

if __name__ == "__main__":
    # a checkout whose package is not installed: its root first, as `python pretrain_fsdp2.py` has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runpy.run_module("fsdp2_backend.cli.merge_datasets", run_name="__main__", alter_sys=True)
