#!/usr/bin/env python
"""Converts one of our training checkpoints, or a Megatron-LM one (torch_dist or legacy torch format, dense or MoE:
see fsdp2_backend/megatron_compat/checkpoint/convert.py and megatron_checkpoint_moe.py), to a Hugging Face directory,
offline, in one process.

    python tools/convert_checkpoint.py CKPT_DIR OUT_DIR [--dtype bf16|fp16|fp32]

CKPT_DIR is an ``iter_*`` checkpoint directory or a save directory (its newest complete checkpoint is
taken). OUT_DIR gets safetensors weights, config.json, generation_config.json and the tokenizer files
carried by the checkpoint: what ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads. It writes the
same files as the end-of-training export (``save_hf_weights``).
"""
from __future__ import annotations

import argparse
import os
import sys


from fsdp2_backend.usage_errors import exit_on_usage_error  # noqa: E402

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="an iter_* checkpoint directory or a --save directory")
    parser.add_argument("out_dir", help="the HF directory to write")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating-point weights (default: as saved)")
    parser.add_argument("--hf-config", default=None,
                        help="Megatron-LM checkpoints only: an HF config directory to use instead of deriving one "
                             "from the checkpoint's saved args")
    args = parser.parse_args(argv)
    with exit_on_usage_error():
        import torch

        from fsdp2_backend.training.hf_export import convert_checkpoint

        from megatron_compat.checkpoint.convert import convert_megatron_checkpoint, megatron_iteration_dir

        dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
        if megatron_iteration_dir(args.checkpoint) is not None:  # a Megatron-LM torch_dist / legacy checkpoint
            out = convert_megatron_checkpoint(args.checkpoint, args.out_dir, dtype=dtype, hf_config=args.hf_config)
        else:
            out = convert_checkpoint(args.checkpoint, args.out_dir, dtype=dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
