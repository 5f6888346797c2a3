#!/usr/bin/env python
"""Entry point, like Megatron's pretrain_gpt.py: `torchrun ... pretrain_fsdp2.py <Megatron flags | CONFIG.yaml>`.

See fsdp2_backend/launch.py for the command line.
"""
import sys

from fsdp2_backend.launch import main

if __name__ == "__main__":
    sys.exit(main())
