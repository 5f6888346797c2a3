#!/usr/bin/env python
"""Generates completions of prompts with a trained model (the native config's `inference` group).

The code is fsdp2_backend/cli/generate.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.generate", run_name="__main__", alter_sys=True)
