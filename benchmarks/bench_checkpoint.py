#!/usr/bin/env python
"""Checkpoint size, save time (sync vs async) and how long the training loop stalls, on gloo/CPU ranks.

    python -m benchmarks.bench_checkpoint [--world-size 2] [--preset demo|small] [--steps 24] [--every 4]
                                          [--repeats 2]

A Qwen3 sharded with FSDP2 and AdamW trains `--steps` steps without saving (the reference), saving
synchronously every `--every` steps, and saving asynchronously (dcp.async_save) as often; each loop runs
`--repeats` times, interleaved, and the best time of each kind counts. The stall
per save is the extra loop time over the reference divided by the number of saves. Also printed: bytes on
disk (with and without optimizer), the time of one save alone, how long async save() takes to return vs
until the write is committed, and the HF export time. Figures depend on the machine's load: say so.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


PRESETS = {
    # the demo's model (tools/demo_assets.py) with a 2048-token vocabulary
    "demo": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=4, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, head_dim=64,
                  num_attention_heads=8, num_key_value_heads=4),
}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _worker(rank, world_size, preset, steps, every, repeats, out_json, workdir):
    with contextlib.redirect_stdout(io.StringIO()):  # the per-save Megatron log lines
        _measure(rank, world_size, preset, steps, every, repeats, out_json, workdir)


def _measure(rank, world_size, preset, steps, every, repeats, out_json, workdir):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.training.checkpoint import CheckpointManager
    from fsdp2_backend.checkpoint.hf_export import export_hf
    from tests.support.tiny_models import tiny_qwen3_config

    torch.set_num_threads(1)
    workdir = Path(workdir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_qwen3_config(**PRESETS[preset]))
    n_params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, PRESETS[preset]["vocab_size"], (2, 128))

    def step():
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    step()  # optimizer state exists from here on
    results = {"params": n_params, "world_size": world_size, "preset": preset}

    sync = CheckpointManager(workdir / "sync")
    results["sync_save_s"] = statistics.median(
        timed(lambda i=i: sync.save(1000 + i, model, optimizer)) for i in range(3))
    results["bytes_with_optimizer"] = _dir_bytes(workdir / "sync" / "iter_0001000")
    only_model = CheckpointManager(workdir / "model_only", save_only_model=True)
    only_model.save(1, model, optimizer)
    results["bytes_model_only"] = _dir_bytes(workdir / "model_only" / "iter_0000001")

    asynchronous = CheckpointManager(workdir / "async", async_save=True)
    returns, totals = [], []
    for i in range(3):
        dist.barrier()
        start = time.perf_counter()
        asynchronous.save(2000 + i, model, optimizer)
        returns.append(time.perf_counter() - start)
        asynchronous.wait()
        dist.barrier()
        totals.append(time.perf_counter() - start)
    results["async_return_s"], results["async_total_s"] = statistics.median(returns), statistics.median(totals)

    def loop(manager):
        for i in range(1, steps + 1):
            step()
            if manager is not None and i % every == 0:
                manager.save(3000 + i, model, optimizer)
        if manager is not None:
            manager.finalize()

    loops = {"reference": lambda: None,
             "sync": lambda: CheckpointManager(workdir / "loop_sync", save_total_limit=1),
             "async": lambda: CheckpointManager(workdir / "loop_async", save_total_limit=1, async_save=True)}
    times = {name: [] for name in loops}
    for _ in range(repeats):  # interleaved, best of `repeats`: the machine's load drifts
        for name, make in loops.items():
            times[name].append(timed(lambda: loop(make())))
    for name, values in times.items():
        results[f"loop_{name}_s"] = min(values)
    results["saves_per_loop"] = steps // every
    results["hf_export_s"] = timed(lambda: export_hf(model, workdir / "hf"))
    results["hf_bytes"] = _dir_bytes(workdir / "hf")
    sync.finalize()
    asynchronous.finalize()
    if rank == 0:
        Path(out_json).write_text(json.dumps(results))


def main() -> None:
    from tests.support.launchers import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="loops of each kind, interleaved; best taken")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        out_json = workdir / "results.json"
        run_distributed(_worker, args.world_size, args.preset, args.steps, args.every, args.repeats,
                        str(out_json), str(workdir))
        r = json.loads(out_json.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    saves = r["saves_per_loop"]
    step_ms = 1000 * r["loop_reference_s"] / args.steps
    stall_sync = 1000 * (r["loop_sync_s"] - r["loop_reference_s"]) / saves
    stall_async = 1000 * (r["loop_async_s"] - r["loop_reference_s"]) / saves
    print(f"model: Qwen3 preset {r['preset']}, {r['params'] / 1e6:.2f} M params, fp32, AdamW, "
          f"{r['world_size']} gloo ranks (CPU)")
    print(f"checkpoint on disk: {r['bytes_with_optimizer'] / 2**20:.1f} MiB with optimizer, "
          f"{r['bytes_model_only'] / 2**20:.1f} MiB model only; HF export {r['hf_bytes'] / 2**20:.1f} MiB "
          f"in {r['hf_export_s'] * 1000:.0f} ms")
    print(f"one save alone: sync {r['sync_save_s'] * 1000:.0f} ms; async returns after "
          f"{r['async_return_s'] * 1000:.0f} ms ({r['async_return_s'] / r['sync_save_s']:.2f}x of sync), "
          f"committed after {r['async_total_s'] * 1000:.0f} ms")
    print(f"loop of {args.steps} steps, a save every {args.every}: reference {r['loop_reference_s']:.2f} s "
          f"({step_ms:.0f} ms/step), sync {r['loop_sync_s']:.2f} s, async {r['loop_async_s']:.2f} s")
    print(f"stall per save: sync {stall_sync:.0f} ms, async {stall_async:.0f} ms "
          f"(async/sync {stall_async / stall_sync if stall_sync > 0 else float('nan'):.2f}); "
          f"{stall_sync / step_ms:.2f} vs {stall_async / step_ms:.2f} steps")


if __name__ == "__main__":
    main()
