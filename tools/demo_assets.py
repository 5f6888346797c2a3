#!/usr/bin/env python
"""Builds the demo's inputs from what is already on the machine: no download.

The code is fsdp2_backend/cli/demo_assets.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.demo_assets", run_name="__main__", alter_sys=True)
