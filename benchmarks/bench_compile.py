"""Regional compilation (`optimization.torch_compile`): the engine's step eager vs compiled vs a bare FSDP2 loop,
dense and MoE, in one run; the first step's compile time and inductor's FX graph cache on a second run.

Each rank builds three sides from the same Megatron flags (`launch.parse_command_line` → `build.build`, mock data
through GPTDataset, NullTokenizer of 32k ids): the engine eager, the engine with `--optimization.torch_compile`,
and the bare loop a person writes by hand (transformers' model, fully_shard per decoder layer + root, AdamW, forward
with labels, backward, step). The engine sides run `Trainer.train_step` (forward/backward of every micro-batch,
loss accounting, clipping, optimizer and scheduler step). The three alternate iteration by iteration, the order
rotating each iteration, so the machine's load falls on all of them alike (the machine is shared: medians, and
ratios measured in the same run). The compiled side's first step (dynamo + inductor compile of the block,
forward and backward) is timed on its own and left out of the medians. One more step per side runs under
torch.profiler: the share of its time in GEMMs and the fused attention, which compiled code calls unchanged
(inductor's extern kernels on CPU), bounds what compiling can gain on this model.

    python -m benchmarks.bench_compile [--steps 8] [--ranks 1] [--models dense,moe]   (from the repository root)

Run it twice: the second run finds the first one's compiled kernels in inductor's FX graph cache (and AOT
autograd's cache) under `TORCHINDUCTOR_CACHE_DIR` (default here: a fixed folder under the system's temp dir,
`--fresh-cache` empties it first), so its first step shows what a restarted job pays; the cache hits and
misses are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tests.support.launchers import run_distributed

SEQ, MBS, GBS, VOCAB = 512, 2, 4, 32000
COMMON = (f"--seq-length {SEQ} --max-position-embeddings {SEQ} --micro-batch-size {MBS} --global-batch-size {GBS} "
          f"--tokenizer-type NullTokenizer --vocab-size {VOCAB - 1} --make-vocab-size-divisible-by 1 "
          f"--untie-embeddings-and-output-weights --disable-bias-linear --position-embedding-type rope "
          f"--normalization RMSNorm --swiglu --mock-data --lr 1e-4 --clip-grad 1.0 --log-interval 1000 "
          f"--eval-iters 0 --attention-dropout 0 --hidden-dropout 0 --distributed-backend gloo")
MODELS = {  # the engine-overhead benchmark's dense model; a Qwen3-MoE of the same width with grouped experts
    "dense": "--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4 --group-query-attention "
             "--num-query-groups 2 --kv-channels 64 --qk-layernorm",
    "moe": "--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4 --group-query-attention "
           "--num-query-groups 2 --kv-channels 64 --qk-layernorm --num-experts 8 --moe-router-topk 2 "
           "--moe-ffn-hidden-size 256 --moe-grouped-gemm",
}
SIDES = ("eager", "compiled", "bare")
DEFAULT_CACHE = os.path.join(tempfile.gettempdir(), "fsdp2_bench_compile_cache")


def _engine(model_flags, steps, world_size, compiled):
    from fsdp2_backend.build import build
    from fsdp2_backend.launch import parse_command_line
    from fsdp2_backend.training.trainer import Trainer

    argv = f"{COMMON} {model_flags} --train-iters {steps + 2}".split()
    if compiled:
        argv += ["--optimization.torch_compile", "True"]
    config, _ = parse_command_line(argv, world_size)
    job = build(config)
    return job, Trainer(job)


def _bare(hf_config, mesh, rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(100 + rank)
    micro_batches = GBS // (MBS * world_size)

    def step():
        for _ in range(micro_batches):
            tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
            (model(input_ids=tokens, labels=tokens, use_cache=False).loss / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - cpu, time.perf_counter() - wall


# Kernels compiled code calls unchanged (inductor's extern kernels on CPU): the GEMMs and the fused attention.
# Their share of a step bounds what compiling can gain: eager / compiled <= eager step / their time.
EXTERN_KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm",
                  "aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def _extern_share(step):
    """(seconds of one profiled `step` in EXTERN_KERNELS, seconds of the whole step), self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in EXTERN_KERNELS) / 1e6, total / 1e6


def _worker(rank, world_size, model_name, steps, out_path):
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    torch.set_num_threads(1)
    eager_job, eager = _engine(MODELS[model_name], steps, world_size, compiled=False)
    compiled_job, compiled = _engine(MODELS[model_name], steps, world_size, compiled=True)
    steps_of = {"eager": eager.train_step, "compiled": compiled.train_step,
                "bare": _bare(eager_job.model.config, eager_job.ctx.fsdp_mesh, rank, world_size)}
    first = {side: _timed(steps_of[side]) for side in SIDES}  # compiled: dynamo + inductor, forward and backward
    times = {side: [] for side in SIDES}
    for iteration in range(steps):
        order = SIDES[iteration % 3:] + SIDES[:iteration % 3]
        for side in order:
            dist.barrier()
            times[side].append(_timed(steps_of[side]))
    result = {side: dict(cpu_ms=1000 * statistics.median(t[0] for t in times[side]),
                         wall_ms=1000 * statistics.median(t[1] for t in times[side]),
                         first_cpu_s=first[side][0], first_wall_s=first[side][1]) for side in SIDES}
    for side in ("eager", "compiled"):
        result[side]["extern_s"], result[side]["profiled_s"] = _extern_share(steps_of[side])
    result["cache"] = {k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k}
    result["cache"].update({k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k})
    result["graphs"] = counters["stats"]["unique_graphs"]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    eager_job.close()
    compiled_job.close()
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed iterations of each side")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks (FSDP over them)")
    parser.add_argument("--models", default="dense,moe", help="comma-separated: dense, moe")
    parser.add_argument("--fresh-cache", action="store_true", help="empty the compile cache first (a cold start)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", DEFAULT_CACHE)
    if args.fresh_cache:
        shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
    print(f"{args.ranks} CPU rank(s) (gloo), 1 thread each, fp32, seq {SEQ}, vocab {VOCAB}, global batch {GBS} "
          f"(micro-batch {MBS}); {args.steps} alternating iterations per side, medians, slowest rank; "
          f"compile cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            out = os.path.join(tmp, f"{name}.json")
            run_distributed(_worker, args.ranks, name, args.steps, out)
            ranks = json.loads(Path(out).read_text())
            slowest = lambda side, key: max(r[side][key] for r in ranks)  # noqa: E731
            print(f"{name} ({MODELS[name]})")
            print(f"  {'side':10s} {'CPU ms/it':>10s} {'wall ms/it':>11s} {'first step CPU s':>17s} "
                  f"{'first step wall s':>18s}")
            for side in SIDES:
                print(f"  {side:10s} {slowest(side, 'cpu_ms'):10.1f} {slowest(side, 'wall_ms'):11.1f} "
                      f"{slowest(side, 'first_cpu_s'):17.2f} {slowest(side, 'first_wall_s'):18.2f}")
            for key in ("cpu_ms", "wall_ms"):
                eager, compiled, bare = (slowest(side, key) for side in SIDES)
                print(f"  {key[:-3]:4s}: eager / compiled = {eager / compiled:.3f}x (goal >= 1.15 dense), "
                      f"bare / compiled = {bare / compiled:.3f}x, eager / bare = {eager / bare:.3f}")
            shares = {side: ranks[0][side]["extern_s"] / ranks[0][side]["profiled_s"] for side in ("eager", "compiled")}
            print(f"  GEMM + attention kernels (called unchanged by compiled code), one profiled step on rank 0: "
                  f"{100 * shares['eager']:.1f}% of eager, {100 * shares['compiled']:.1f}% of compiled; "
                  f"eager / compiled could reach at most {1 / shares['eager']:.2f}x if compiling removed all else")
            print(f"  compile: {ranks[0]['graphs']} graph(s) on rank 0; cache counters {ranks[0]['cache']}")


if __name__ == "__main__":
    main()
