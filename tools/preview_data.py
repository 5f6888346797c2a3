#!/usr/bin/env python
"""Shows what the model sees in fine-tuning: the first examples of a config's SFT data, tokenized by its template.

The code is fsdp2_backend/cli/preview_data.py (installed with the project); this script runs it as Megatron users expect.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("fsdp2_backend.cli.preview_data", run_name="__main__", alter_sys=True)
