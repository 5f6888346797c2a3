"""Gated DeltaNet: our chunked torch reference (`kernels.gated_delta_rule`) vs transformers' torch fallback
(`torch_chunk_gated_delta_rule`, what Qwen3-Next runs without flash-linear-attention): tokens/s of
forward+backward and peak memory, at several sequence lengths, measured in the same run.

Each (implementation, length) runs in its own subprocess so its peak RSS is its own (CPU); on an accelerator
the allocator's peak is read instead. The triton kernel is not timed here: under the interpreter it is a
correctness check only (tests/kernels/test_gated_delta_rule_triton.py).
Run: python benchmarks/bench_gdn.py [--lengths 4096 16384 --heads 4 --k-heads 2 --head-dim 128 --chunk 64]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


IMPLEMENTATIONS = ("ours", "transformers")


def _measure(impl: str, length: int, heads: int, k_heads: int, dim: int, chunk: int, device: str,
             repeats: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from fsdp2_backend.training.logging import peak_memory_bytes

    if impl == "ours":
        from fsdp2_backend.kernels.gated_delta_rule import chunk_gated_delta_rule_reference as fn
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule as fn
    torch.manual_seed(0)
    dev = torch.device(device)
    q = torch.randn(1, length, k_heads, dim, device=dev, requires_grad=True)
    k = torch.randn(1, length, k_heads, dim, device=dev, requires_grad=True)
    v = torch.randn(1, length, heads, dim, device=dev, requires_grad=True)
    g = (-torch.rand(1, length, heads, device=dev) * 0.1).requires_grad_()
    beta = torch.rand(1, length, heads, device=dev).requires_grad_()
    # One untimed step on a short prefix first, for both implementations: library initialisation (BLAS, autograd)
    # would otherwise land in the first timed repeat, which with --repeats 2 left one warm sample.
    short = min(length, 512)
    out, _ = fn(*(x[:, :short] for x in (q, k, v, g, beta)), chunk_size=chunk, use_qk_l2norm_in_kernel=True)
    out.float().square().mean().backward()
    for x in (q, k, v, g, beta):
        x.grad = None
    base = peak_memory_bytes(dev)
    times, cpu_times = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        out, _ = fn(q, k, v, g, beta, chunk_size=chunk, use_qk_l2norm_in_kernel=True)
        out.float().square().mean().backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        for x in (q, k, v, g, beta):
            x.grad = None
    # On a CPU shared with other jobs the process's CPU time is the stable figure (wall time is printed too);
    # on an accelerator wall time is the figure.
    step = min(cpu_times) if dev.type == "cpu" else min(times)
    return {"peak_bytes": peak_memory_bytes(dev), "base_bytes": base, "step_s": step, "wall_s": min(times),
            "checksum": float(out.detach().double().sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--k-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: CPU time = work done)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        impl, length = args.child.split(":")
        print(json.dumps(_measure(impl, int(length), args.heads, args.k_heads, args.head_dim, args.chunk,
                                  args.device, args.repeats, args.threads)))
        return
    print(f"gated delta rule fwd+bwd: heads={args.heads} k_heads={args.k_heads} head_dim={args.head_dim} "
          f"chunk={args.chunk} device={args.device} threads={args.threads} (CPU: step = process CPU seconds)")
    results = {}
    for length in args.lengths:
        for impl in IMPLEMENTATIONS:
            cmd = [sys.executable, __file__, "--heads", str(args.heads), "--k-heads", str(args.k_heads),
                   "--head-dim", str(args.head_dim), "--chunk", str(args.chunk), "--device", args.device,
                   "--repeats", str(args.repeats), "--threads", str(args.threads), "--child", f"{impl}:{length}"]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            results[impl, length] = r
            growth = (r["peak_bytes"] - r["base_bytes"]) / 2**20
            print(f"seq {length:6d} {impl:12s} {length / r['step_s']:10.0f} tokens/s  step {r['step_s']:7.2f} s (wall {r['wall_s']:7.2f})  "
                  f"peak {r['peak_bytes'] / 2**20:8.1f} MiB (above start {growth:8.1f})", flush=True)
        ours, theirs = results["ours", length], results["transformers", length]
        grow = lambda r: max(r["peak_bytes"] - r["base_bytes"], 1)  # noqa: E731
        print(f"seq {length:6d} speed-up ours/transformers {theirs['step_s'] / ours['step_s']:.2f}x, "
              f"peak growth ours/transformers {grow(ours) / grow(theirs):.2f}, outputs agree to "
              f"{abs(ours['checksum'] - theirs['checksum']) / max(abs(theirs['checksum']), 1e-9):.1e} (relative)")
    first, last = args.lengths[0], args.lengths[-1]
    if last != first:
        for impl in IMPLEMENTATIONS:
            a, b = results[impl, first], results[impl, last]
            print(f"{impl}: seq x{last / first:.0f} → peak growth x"
                  f"{max(b['peak_bytes'] - b['base_bytes'], 1) / max(a['peak_bytes'] - a['base_bytes'], 1):.2f}, "
                  f"step time x{b['step_s'] / a['step_s']:.2f}")


if __name__ == "__main__":
    main()
