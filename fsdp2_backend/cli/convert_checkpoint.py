#!/usr/bin/env python
"""Converts one of our training checkpoints, or a Megatron-LM one (torch_dist or legacy torch format, dense or MoE:
see megatron_compat/checkpoint/convert.py and moe.py), to a Hugging Face directory, offline.

    python tools/convert_checkpoint.py CKPT_DIR OUT_DIR [--dtype bf16|fp16|fp32] [--max-shard-size 5GB]
    torchrun --nproc_per_node 8 tools/convert_checkpoint.py CKPT_DIR OUT_DIR    # the shards split over 8 ranks

CKPT_DIR is an ``iter_*`` checkpoint directory or a save directory (its newest complete checkpoint is
taken). OUT_DIR gets safetensors weights, config.json, generation_config.json and the tokenizer files
carried by the checkpoint: what ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads. It writes the
same files as the end-of-training export (``save_hf_weights``), in safetensors shards of at most
``--max-shard-size`` with ``model.safetensors.index.json``: one of our checkpoints is read one shard at a time,
so a process holds one shard, not the model; under ``torchrun`` (gloo, no devices) the ranks share the shards.
A Megatron-LM checkpoint is read whole by megatron_compat/checkpoint/convert.py, then written the same way.
"""
from __future__ import annotations

import argparse
import os
import re


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
    parser.add_argument("--max-shard-size", default="5GB",
                        help="the largest safetensors file (e.g. 500MB, 5GB); a converting process holds one")
    args = parser.parse_args(argv)
    with exit_on_usage_error():
        import torch
        import torch.distributed as dist

        from fsdp2_backend.usage_errors import UsageError

        from fsdp2_backend.checkpoint.hf_export import convert_checkpoint

        from megatron_compat.checkpoint.convert import convert_megatron_checkpoint
        from megatron_compat.checkpoint.layout import megatron_iteration_dir

        dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
        shard_bytes = _bytes(args.max_shard_size)
        if shard_bytes is None:
            raise UsageError(f"--max-shard-size: {args.max_shard_size!r} is no size — give e.g. 500MB or 5GB")
        if megatron_iteration_dir(args.checkpoint) is not None:  # a Megatron-LM torch_dist / legacy checkpoint
            out = convert_megatron_checkpoint(args.checkpoint, args.out_dir, dtype=dtype, hf_config=args.hf_config)
        else:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: the ranks share the shards
                dist.init_process_group("gloo")
            try:
                out = convert_checkpoint(args.checkpoint, args.out_dir, dtype=dtype, shard_bytes=shard_bytes)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {out}")


def _bytes(text: str):
    """'500MB' / '5GB' / '1024' → bytes (None for anything else)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)B?\s*", text.upper())
    if not match:
        return None
    return int(float(match[1]) * 1024 ** " KMGT".index(match[2] or " "))


if __name__ == "__main__":
    main()
