#!/usr/bin/env python
"""Megatron-LM's `tools/preprocess_data.py`, same flags and same output bytes, faster.

The code is fsdp2_backend/cli/preprocess_data.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.preprocess_data", run_name="__main__", alter_sys=True)
