#!/usr/bin/env python
"""Mamba-3 scan: step time and peak memory of our chunked scan vs the quadratic reference MindSpeed-LLM runs.

    python benchmarks/bench_mamba3.py [--lengths 2048 8192 32768] [--heads 4] [--headdim 64] [--dstate 64]
                                      [--chunk 64] [--device cpu|cuda] [--max-gib 6]

One "step" = forward + backward of the SISO scan for one sequence (batch 1): ours is
`kernels.mamba3_scan.mamba3_chunk_scan` (chunked, linear in length); the reference is a transcription of
MindSpeed-LLM's `mamba3_siso_fwd_ref` (mindspeed_llm/fsdp2/models/mamba3/mamba3_block.py: the Mamba-3 SSD
written as one (heads × L × L) masked attention-like matrix per sequence, with a (L × L) segment-sum per head),
which its model calls for every SISO layer. Each (implementation, length) runs in a fresh process. Memory:
on cuda the allocator's peak above the inputs; on cpu (no allocator statistics) the bytes autograd saves
for backward (unique storages, counted by a saved-tensors hook), i.e. the activation memory a training step
holds — the part that grows with length. A reference whose L² tensors would exceed `--max-gib` is skipped
and says so. The two outputs are
compared at the shortest length. CPU figures depend on the machine's load: say so when quoting them.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time



def quadratic_reference(q, k, v, adt, dt, trap, angles):
    """MindSpeed's SISO reference (transcribed, batch 1, no initial state; no D / z: the scan's part only).
    q, k (1, L, 1, H, N) biased; v (1, L, 1, H, P); adt, dt, trap (1, L, H); angles (1, L, H, A)."""
    import torch
    import torch.nn.functional as F

    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]  # (L, H, ·)
    adt, dt, trap, angles = adt[0].T, dt[0].T, torch.sigmoid(trap[0].T), angles[0]  # (H, L)
    L = q.shape[0]
    theta = torch.cumsum(torch.tanh(angles) * math.pi * dt.T.unsqueeze(-1), dim=0)
    theta = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    dt_next = F.pad(dt[:, 1:], (0, 1))
    shifted_gamma = dt_next * (1 - F.pad(trap[:, 1:], (0, 1)))
    scale = dt * trap + shifted_gamma
    qk_dot = (q * k).sum(-1) * shifted_gamma.T  # (L, H): the diagonal correction, on unrotated q, k

    def rotary(x):
        a = theta.shape[-1]
        x0, x1 = x[..., :2 * a:2], x[..., 1:2 * a:2]
        c, s = torch.cos(theta), torch.sin(theta)
        rot = torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], dim=-1).flatten(-2)
        return torch.cat([rot, x[..., 2 * a:]], dim=-1)

    q, k = rotary(q), rotary(k)
    k_scaled = k * scale.T.unsqueeze(-1)
    qk = torch.tril(torch.einsum("thd,shd->hts", q, k_scaled))
    seg = adt.unsqueeze(-1).expand(-1, L, L)  # MindSpeed's _segsum: (H, L, L) per sequence
    mask = torch.tril(torch.ones(L, L, dtype=torch.bool), diagonal=-1)
    segsum = torch.cumsum(seg.masked_fill(~mask, 0), dim=-2)
    segsum = segsum.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool)), -torch.inf)
    out = torch.einsum("hts,shd->thd", qk * torch.exp(segsum), v)
    return (out - v * qk_dot.unsqueeze(-1))[None, :, None]


def _inputs(length, heads, headdim, dstate, device):
    import torch

    g = torch.Generator().manual_seed(0)
    shape = (1, length, 1, heads)
    q = torch.randn(*shape, dstate, generator=g)
    k = torch.randn(*shape, dstate, generator=g)
    v = torch.randn(*shape, headdim, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(1, length, heads, generator=g) - 2)
    adt = -torch.nn.functional.softplus(torch.randn(1, length, heads, generator=g)) * dt
    trap = torch.randn(1, length, heads, generator=g)
    angles = torch.randn(1, length, heads, dstate // 4, generator=g)
    return [t.to(device).requires_grad_() for t in (q, k, v, adt, dt, trap, angles)]


def _child(args) -> None:
    """One measurement in this (fresh) process; prints one JSON line."""
    import torch

    from fsdp2_backend.kernels.mamba3_scan import mamba3_chunk_scan

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    inputs = _inputs(args.length, args.heads, args.headdim, args.dstate, args.device)
    run = (lambda: mamba3_chunk_scan(*inputs, chunk_size=args.chunk)) if args.impl == "ours" else \
        (lambda: quadratic_reference(*inputs))
    cuda = args.device == "cuda"
    saved = {}  # storage → bytes of every tensor autograd keeps for backward: the activation memory

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    times, peak = [], None
    for i in range(args.repeats):
        saved.clear()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = run()
        y.backward(torch.ones_like(y))
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        times.append(time.perf_counter() - start)
        out = y.detach()[0, :256].double().cpu()
        del y
        for t in inputs:
            t.grad = None
    saved_bytes = sum(saved.values())
    print(json.dumps({"time_s": min(times), "peak_bytes": peak if cuda else saved_bytes,
                      "saved_bytes": saved_bytes, "head": out.flatten().tolist()[:512]}))
    return


def _measure(impl, length, args):
    cmd = [sys.executable, __file__, "--child", impl, "--length", str(length), "--heads", str(args.heads),
           "--headdim", str(args.headdim), "--dstate", str(args.dstate), "--chunk", str(args.chunk),
           "--device", args.device, "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--dstate", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=2, help="runs per measurement; the fastest counts")
    p.add_argument("--max-gib", type=float, default=6.0, help="skip a reference whose L² tensors exceed this")
    p.add_argument("--child", choices=["ours", "reference"])
    p.add_argument("--length", type=int)
    args = p.parse_args()
    if args.child:
        args.impl = args.child
        _child(args)
        return
    print(f"Mamba-3 SISO scan, forward+backward, batch 1, heads {args.heads}, headdim {args.headdim}, "
          f"d_state {args.dstate}, chunk {args.chunk}, device {args.device}")
    print(f"memory: {'peak allocated above the inputs' if args.device == 'cuda' else 'saved for backward'} (MiB)")
    print(f"{'length':>7} | {'ours s':>8} {'ours MiB':>9} | {'ref s':>8} {'ref MiB':>9} | {'mem ratio':>9}")
    first = None
    for length in args.lengths:
        ours = _measure("ours", length, args)
        # the reference holds ~6 (H, L, L) fp32 tensors for backward (qk, tril, segsum, exp, product, grads)
        need_gib = 6 * args.heads * length * length * 4 / 2 ** 30
        ref = _measure("reference", length, args) if need_gib <= args.max_gib else \
            {"error": f"skipped: needs ~{need_gib:.0f} GiB (> --max-gib {args.max_gib:g})"}
        if first is None and "head" in ours and "head" in ref:
            first = max(abs(a - b) for a, b in zip(ours["head"], ref["head"]))
        o_mib = ours.get("peak_bytes", float("nan")) / 2 ** 20
        r_mib = ref.get("peak_bytes", float("nan")) / 2 ** 20
        ratio = f"{r_mib / o_mib:9.1f}" if "peak_bytes" in ref and o_mib > 0 else f"{'-':>9}"
        print(f"{length:>7} | {ours.get('time_s', float('nan')):8.3f} {o_mib:9.1f} | "
              f"{ref.get('time_s', float('nan')):8.3f} {r_mib:9.1f} | {ratio}"
              + (f"   reference {ref['error']}" if "error" in ref else "")
              + (f"   ours {ours['error']}" if "error" in ours else ""))
    if first is not None:
        print(f"outputs agree at length {args.lengths[0]}: max |ours - reference| = {first:.2e} (first 256 tokens)")


if __name__ == "__main__":
    main()
