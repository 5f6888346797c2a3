#!/usr/bin/env python
"""Builds the demo's inputs from what is already on the machine: no download.

The code is fsdp2_backend/cli/demo_assets.py; this script runs it, installed or not, as Megatron users expect.
"""
import os
import runpy
import sys

if __name__ == "__main__":
    # a checkout whose package is not installed: its root first, as `python pretrain_fsdp2.py` has it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    runpy.run_module("fsdp2_backend.cli.demo_assets", run_name="__main__", alter_sys=True)
