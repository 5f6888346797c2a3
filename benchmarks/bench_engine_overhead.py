"""Engine overhead: the entry point's step time against a bare FSDP2 loop, what each on-by-default feature costs,
and memory per rank at 2 vs 1 ranks.

The engine side is what `pretrain_fsdp2.py` runs: Megatron flags → `launch.parse_command_line` → `build.build`
(mock data through Megatron's GPTDataset and samplers, NullTokenizer of 32k ids, the model built from the
flags) → `Trainer.train()`, with Megatron's defaults (loss accounting, global gradient norm and clipping at 1.0,
NaN check, skip checks, the log line every iteration here). The bare side is the minimum a person writes by
hand on the same HF Qwen3 (4 layers, hidden 256, seq 512, vocab 32k): fully_shard per decoder layer + root, fp32,
AdamW, two micro-batches of 2 per rank (global batch 8 on 2 ranks): forward with labels, backward, step,
zero_grad — no clipping, so everything the engine adds counts as overhead.

The two alternate iteration by iteration inside one process per rank: the bare step runs from a hook the loop
calls once per iteration (where the profiler's step goes), so the engine's iteration is the time between two
hooks minus the bare step. On a shared machine wall time is noisy: the figures compared are the CPU time of the
process (all its threads, gloo's included) per iteration, median over the iterations, slowest rank; wall-clock
medians are printed beside them. Each engine feature's own cost (CPU ms per iteration, median) is measured by
timing the call that implements it inside the same loop.

    python -m benchmarks.bench_engine_overhead [--steps 10]   (from the repository root)

Prints step times, the overhead ratio (goal <= 1.03), the per-feature rows, and per-rank memory: the model state
this rank holds (parameters + gradients + AdamW moments, local shards) and the process's peak RSS, at 2 ranks and
1 rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from tests.support.launchers import run_distributed

SEQ, MBS, GBS, VOCAB = 512, 2, 8, 32000
FLAGS = (f"--num-layers 4 --hidden-size 256 --ffn-hidden-size 704 --num-attention-heads 4 --group-query-attention "
         f"--num-query-groups 2 --kv-channels 64 --qk-layernorm --seq-length {SEQ} --max-position-embeddings {SEQ} "
         f"--micro-batch-size {MBS} --global-batch-size {GBS} --tokenizer-type NullTokenizer "
         f"--vocab-size {VOCAB - 1} --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights "
         f"--disable-bias-linear --position-embedding-type rope --normalization RMSNorm --swiglu --mock-data "
         f"--lr 1e-4 --clip-grad 1.0 --log-interval 1 --eval-iters 0 --attention-dropout 0 --hidden-dropout 0 "
         f"--distributed-backend gloo").split()
# Each on-by-default feature of the loop: (row label, what is timed).
FEATURES = ("data loader (next micro-batch)", "loss accounting (all-reduce, lm loss to host)",
            "gradient norm + clipping", "log line (record + print)", "scheduler step",
            "exit checks (time, signal)", "router / MTP hooks (off)")


def _state_bytes(model, optimizer):
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    total = sum(local(p).numel() * p.element_size() * 2 for p in model.parameters())  # params + grads
    for torch_optimizer in optimizer:  # the engine's CombinedOptimizer
        for state in torch_optimizer.state.values():
            total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())
    return total


class _Costs:
    """CPU seconds spent in each feature during the current iteration."""

    def __init__(self):
        self.current, self.per_iteration = defaultdict(float), []

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[name] += time.process_time() - start
        return timed

    def next_iteration(self):
        self.per_iteration.append(dict(self.current))
        self.current.clear()


class _TimedBatches:
    def __init__(self, batches, costs):
        self.batches, self.costs = batches, costs

    def __iter__(self):
        return self

    def __next__(self):
        return self.costs.wrap(FEATURES[0], next)(self.batches)


class _Alternate:
    """Stands where the loop calls the profiler: ends the engine's iteration, runs one bare step, starts the next."""

    def __init__(self, bare_step, costs):
        import torch.distributed as dist

        self.barrier, self.bare_step, self.costs = dist.barrier, bare_step, costs
        self.engine, self.bare, self.engine_wall, self.bare_wall = [], [], [], []
        self.mark = None

    def step(self, iteration):
        cpu, wall = time.process_time(), time.perf_counter()
        if self.mark is not None:
            self.engine.append(cpu - self.mark[0])
            self.engine_wall.append(wall - self.mark[1])
        self.costs.next_iteration()
        self.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        self.bare_step()
        self.bare.append(time.process_time() - cpu)
        self.bare_wall.append(time.perf_counter() - wall)
        self.barrier()
        self.mark = time.process_time(), time.perf_counter()

    def close(self):
        pass


def _worker(rank, world_size, steps, out_path):
    import resource

    import fsdp2_backend.training.trainer as trainer_module
    from fsdp2_backend.build import build
    from fsdp2_backend.launch import parse_command_line

    torch.set_num_threads(1)
    config, _ = parse_command_line(FLAGS + ["--train-iters", str(steps + 2)], world_size)
    job = build(config)
    costs = _Costs()

    class TimedLoss(trainer_module.GlobalBatchLoss):
        def finish(self, parameters=()):
            return costs.wrap(FEATURES[1], super().finish)(parameters)

    trainer_module.GlobalBatchLoss = TimedLoss
    trainer = trainer_module.Trainer(job)
    trainer.train_batches = _TimedBatches(trainer.train_batches, costs)
    trainer.optimizer_step.clip_fn = costs.wrap(FEATURES[2], trainer.optimizer_step.clip_fn)
    trainer.logger.record = costs.wrap(FEATURES[3], trainer.logger.record)
    trainer.scheduler.step = costs.wrap(FEATURES[4], trainer.scheduler.step)
    trainer.exit_timer.should_exit = costs.wrap(FEATURES[5], trainer.exit_timer.should_exit)
    trainer.exit_signal.should_exit = costs.wrap(FEATURES[5], trainer.exit_signal.should_exit)
    hooks = trainer.optimizer_step.hooks.after_step  # the plan's router / indexer hooks and the MTP means
    for name, hook in list(hooks.items()):
        hooks[name] = costs.wrap(FEATURES[6], hook)

    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    bare_model = AutoModelForCausalLM.from_config(job.model.config, dtype=torch.float32)
    for layer in bare_model.model.layers:
        fully_shard(layer, mesh=job.ctx.fsdp_mesh)
    fully_shard(bare_model, mesh=job.ctx.fsdp_mesh)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(100 + rank)
    micro_batches = GBS // (MBS * world_size)

    def bare_step():
        for _ in range(micro_batches):
            tokens = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
            loss = bare_model(input_ids=tokens, labels=tokens, use_cache=False).loss / micro_batches
            loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    trainer.profiler = _Alternate(bare_step, costs)
    try:
        trainer.train()
    finally:
        job.close()
    alt = trainer.profiler
    skip = 1  # the first of each: allocations, first all-gathers
    features = {name: 1000 * statistics.median([it.get(name, 0.0) for it in costs.per_iteration[1 + skip:]])
                for name in FEATURES}
    result = dict(engine_ms=1000 * statistics.median(alt.engine[skip:]), bare_ms=1000 * statistics.median(alt.bare[skip:]),
                  engine_wall_ms=1000 * statistics.median(alt.engine_wall[skip:]),
                  bare_wall_ms=1000 * statistics.median(alt.bare_wall[skip:]), features=features,
                  state_bytes=_state_bytes(job.model, job.optimizer),
                  peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    import torch.distributed as dist

    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed iterations of each side")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world, steps in ((2, args.steps), (1, 2)):
            out = os.path.join(tmp, f"w{world}.json")
            run_distributed(_worker, world, steps, out)
            results[world] = json.loads(Path(out).read_text())
    two = results[2]
    slowest = lambda key: max(r[key] for r in two)  # noqa: E731
    engine, bare = slowest("engine_ms"), slowest("bare_ms")
    print(f"model: Qwen3 4 layers, hidden 256, vocab {VOCAB}, seq {SEQ}, global batch {GBS} (micro-batch {MBS}), "
          f"fp32, AdamW, clip 1.0, fully_shard per layer + root")
    print(f"2 CPU ranks (gloo), {args.steps} alternating iterations, median CPU time per iteration (slowest rank); "
          f"wall-clock medians in brackets:")
    print(f"  bare FSDP2 loop        : {bare:8.1f} ms  [{slowest('bare_wall_ms'):8.1f} ms]")
    print(f"  entry point (Trainer)  : {engine:8.1f} ms  [{slowest('engine_wall_ms'):8.1f} ms]")
    print(f"  entry point / bare     : {engine / bare:.3f}  (goal <= 1.03)")
    print("  what each on-by-default feature costs per iteration (CPU ms, median, slowest rank):")
    for name in FEATURES:
        cost = max(r["features"][name] for r in two)
        print(f"    {name:48s}: {cost:7.2f} ms  ({100 * cost / bare:5.2f}% of the bare step)")
    for world in (1, 2):
        state = max(r["state_bytes"] for r in results[world]) / 2 ** 20
        rss = max(r["peak_rss"] for r in results[world]) / 2 ** 20
        print(f"  {world} rank(s): model state per rank {state:7.1f} MiB, peak RSS per rank {rss:7.1f} MiB")
    ratio = max(r["state_bytes"] for r in results[2]) / max(r["state_bytes"] for r in results[1])
    print(f"  model state per rank, 2 ranks / 1 rank: {ratio:.3f}")


if __name__ == "__main__":
    main()
