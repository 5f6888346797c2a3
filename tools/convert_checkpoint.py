#!/usr/bin/env python
"""Converts one of our training checkpoints, or a Megatron-LM one (torch_dist or legacy torch format, dense or MoE:

The code is fsdp2_backend/cli/convert_checkpoint.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.convert_checkpoint", run_name="__main__", alter_sys=True)
