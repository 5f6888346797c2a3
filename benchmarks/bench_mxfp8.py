"""MXFP8 training on 2 CPU ranks (gloo, emulated MX): bytes FSDP all-gathers per step and step time, for bf16
(no quantisation), MXFP8 with a bf16 all-gather, and MXFP8 with the low-precision all-gather (on-demand, all).

The bytes are exact (FSDP2's all-gathers counted as they run). The times are CPU emulation: the MX GEMMs are
dequantise + bf16 matmul and the casts are torch code, so MXFP8 is SLOWER here than bf16. Every speed-up of
MXFP8 — the 2x GEMM throughput and the halved all-gather time — needs MX hardware (Blackwell-class GPUs with
MX tensor cores, Ascend NPUs with MX matmul); the byte saving of the low-precision all-gather is real anywhere
and shows on a network-bound cluster.
Run: python -m benchmarks.bench_mxfp8 [--hidden 256 --layers 4 --steps 6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from tests.support.launchers import run_distributed  # noqa: E402  (the repo's gloo launcher)
from tests.support.tiny_models import tiny_qwen3_config

VARIANTS = {"bf16": None, "mxfp8, bf16 all-gather": (False, "on-demand"),
            "mxfp8, low-precision on-demand": (True, "on-demand"), "mxfp8, low-precision all": (True, "all")}


def _run(model_dir, variant, steps, seq):
    from fsdp2_backend.config import Config
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism

    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "bf16"
    if VARIANTS[variant] is not None:
        config.model.quant_recipe_name = "mxfp8"
        config.model.enable_fsdp_low_precision_all_gather, config.model.fsdp_low_precision_all_gather_mode = \
            VARIANTS[variant]
    ctx = ParallelContext.create(config.parallel)
    model = create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                         parallelize=lambda m: apply_parallelism(m, config, ctx))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(ctx.rank))
    gathered, real = [], torch.distributed.all_gather_single

    def counting(output, tensor, *args, **kwargs):
        gathered.append(output.numel() * output.element_size())
        return real(output, tensor, *args, **kwargs)

    torch.distributed.all_gather_single = counting
    times = []
    try:
        for _ in range(steps + 1):  # the first step warms up
            gathered.clear()
            torch.distributed.barrier()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    finally:
        torch.distributed.all_gather_single = real
    ctx.close()
    return sum(gathered), statistics.median(times[1:])


def _worker(rank, world, model_dir, steps, seq, out):
    results = {variant: _run(model_dir, variant, steps, seq) for variant in VARIANTS}
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(results, handle)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    from transformers import Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        config = tiny_qwen3_config(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                   num_hidden_layers=args.layers, num_attention_heads=args.hidden // 32,
                                   num_key_value_heads=args.hidden // 64, head_dim=32, vocab_size=512)
        Qwen3ForCausalLM(config).save_pretrained(tmp)
        out = os.path.join(tmp, "results.json")
        run_distributed(_worker, 2, tmp, args.steps, args.seq, out)
        with open(out) as handle:
            results = json.load(handle)
    base_bytes, base_time = results["bf16"]
    print(f"2 CPU ranks, Qwen3 hidden {args.hidden} x {args.layers} layers, seq {args.seq}, micro batch 2; "
          f"median of {args.steps} steps")
    print(f"{'variant':34s} {'all-gathered / step':>20s} {'vs bf16':>8s} {'step (ms)':>10s} {'vs bf16':>8s}")
    for variant, (nbytes, seconds) in results.items():
        print(f"{variant:34s} {nbytes / 2**20:17.2f} MiB {nbytes / base_bytes:8.2f} {seconds * 1e3:10.1f} "
              f"{seconds / base_time:8.2f}")
    print("bytes: exact on any device. times: CPU emulation of MX (dequantise + bf16 GEMM) — the MXFP8 GEMM and "
          "all-gather speed-ups need MX hardware (Blackwell-class GPUs, Ascend MX matmul).")


if __name__ == "__main__":
    main()
