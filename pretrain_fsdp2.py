#!/usr/bin/env python
"""Entry point, like Megatron's pretrain_gpt.py: `torchrun ... pretrain_fsdp2.py <Megatron flags | CONFIG.yaml>`.

See fsdp2_backend/launch.py for the command line.
"""
import os
import sys

from fsdp2_backend.distributed.launcher_watch import end_with_launcher

if __name__ == "__main__":
    end_with_launcher()  # a torchrun worker ends with torchrun (it used to train on after a kill -9 of torchrun)
    from fsdp2_backend.launch import main

    code = main()
    # The run is over and everything it wrote is closed (checkpoints, export, logs, the process group). Leave
    # without the interpreter's teardown: there a gloo background thread still being destroyed now and then aborts
    # a finished rank ("terminate called without an active exception", exit -6), and torchrun then reports a run
    # that succeeded as failed. Errors never reach here (they exit through SystemExit with their own code).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
