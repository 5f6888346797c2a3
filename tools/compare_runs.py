#!/usr/bin/env python
"""A migration report: lay a new run over an old one, metric by metric, with a verdict and a plot.

The code is fsdp2_backend/cli/compare_runs.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.compare_runs", run_name="__main__", alter_sys=True)
