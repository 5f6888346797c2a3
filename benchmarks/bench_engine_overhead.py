"""Engine overhead: the Trainer's step time against a bare FSDP2 loop, and memory per rank at 2 vs 1 ranks.

Both sides train the same HF Qwen3 (4 layers, hidden 256, seq 512) from the same weights with AdamW on the
same data, fully_shard per decoder layer + root, fp32. The bare loop is the minimum a person writes by hand:
forward with labels, backward, step, zero_grad — no clipping, so everything the engine adds counts as
overhead (with torch's clip_grad_norm_ over the DTensor gradients the bare loop was the slower one here).
The engine adds Megatron's loss accounting, the global gradient norm and clipping, skip checks and a
Megatron log line every step. The two alternate step by step and the median step time of each is
compared, so machine load hits both alike.

    python benchmarks/bench_engine_overhead.py [--steps 12]

Prints step times, the overhead ratio (target <= 5%), and per-rank memory: the model state this rank holds
(parameters + gradients + AdamW moments, local shards) and the process's peak RSS, at 2 ranks and 1 rank.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


from tests.helpers import run_distributed, tiny_qwen3_config  # noqa: E402

SEQ, MBS, VOCAB = 512, 2, 2048


def _model_config():
    return tiny_qwen3_config(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             max_position_embeddings=SEQ)


def _batches(rank, count):
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(count):
        text = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=gen)
        yield dict(tokens=text[:, :-1], labels=text[:, 1:], loss_mask=torch.ones(MBS, SEQ),
                   position_ids=torch.arange(SEQ).expand(MBS, SEQ))


def _build(model_dir, config, ctx):
    from fsdp2_backend.models.loading import create_model, load_hf_config
    from fsdp2_backend.parallel.apply import apply_parallelism

    return create_model(config.model, load_hf_config(config.model), seed=0, device=ctx.device.torch_device,
                        parallelize=lambda m: apply_parallelism(m, config, ctx))


def _state_bytes(model, optimizer):
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    total = sum(local(p).numel() * p.element_size() * 2 for p in model.parameters())  # params + grads
    for state in optimizer.state.values():
        total += sum(local(v).numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim())
    return total


def _timed(step):
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def _worker(rank, world_size, model_dir, steps, out_path):
    import resource

    import torch.distributed as dist

    from fsdp2_backend.build import TrainJob
    from fsdp2_backend.config import Config
    from fsdp2_backend.distributed.context import ParallelContext
    from fsdp2_backend.training.trainer import Trainer

    torch.set_num_threads(1)
    config = Config()
    config.model.model_name_or_path = model_dir
    config.parallel.param_dtype = "fp32"
    config.parallel.fsdp_modules = ["model.layers.{}"]
    config.training.per_device_train_batch_size = MBS
    ctx = ParallelContext.create(config.parallel)

    engine_model = _build(model_dir, config, ctx)
    engine_opt = torch.optim.AdamW(engine_model.parameters(), lr=1e-4)
    trainer = Trainer(TrainJob(config=config, ctx=ctx, model=engine_model, optimizer=engine_opt,
                               scheduler=type("NoSchedule", (), {"step": lambda s, n: None})(),
                               train_batches=_batches(rank, 10 ** 6), train_iters=10 ** 6, micro_batches=1))

    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    bare_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in bare_model.model.layers:
        fully_shard(layer, mesh=ctx.fsdp_mesh)
    fully_shard(bare_model, mesh=ctx.fsdp_mesh)
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    bare_data = _batches(rank, 10 ** 6)

    def bare_step():
        batch = next(bare_data)
        loss = bare_model(input_ids=batch["tokens"], labels=batch["tokens"], use_cache=False).loss
        loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)

    trainer.train_step(), bare_step()  # warm-up (allocations, first all-gathers)
    engine, bare = [], []
    for i in range(steps):  # alternate step by step (order flipped each time): load hits both alike
        for name in (("bare", "engine") if i % 2 == 0 else ("engine", "bare")):
            dist.barrier()
            if name == "bare":
                bare.append(_timed(bare_step))
            else:
                engine.append(_timed(trainer.train_step))
    result = dict(engine_ms=1000 * statistics.median(engine), bare_ms=1000 * statistics.median(bare),
                  state_bytes=_state_bytes(engine_model, engine_opt),
                  peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    gathered = [None] * world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="timed steps of each side")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Qwen3ForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        Qwen3ForCausalLM(_model_config()).save_pretrained(tmp)
        results = {}
        for world in (2, 1):
            out = os.path.join(tmp, f"w{world}.json")
            run_distributed(_worker, world, tmp, args.steps, out)
            results[world] = json.loads(Path(out).read_text())
    two = results[2]
    engine = max(r["engine_ms"] for r in two)
    bare = max(r["bare_ms"] for r in two)
    print(f"model: Qwen3 4 layers, hidden 256, seq {SEQ}, micro-batch {MBS}, fp32, fully_shard per layer + root")
    print(f"2 CPU ranks (gloo), median of {args.steps} alternating steps each, slowest rank:")
    print(f"  bare FSDP2 loop: {bare:8.1f} ms/step")
    print(f"  engine Trainer : {engine:8.1f} ms/step")
    print(f"  engine overhead: {100 * (engine / bare - 1):+.1f}%  (target <= +5%)")
    for world in (1, 2):
        state = max(r["state_bytes"] for r in results[world]) / 2 ** 20
        rss = max(r["peak_rss"] for r in results[world]) / 2 ** 20
        print(f"  {world} rank(s): model state per rank {state:7.1f} MiB, peak RSS per rank {rss:7.1f} MiB")
    ratio = max(r["state_bytes"] for r in results[2]) / max(r["state_bytes"] for r in results[1])
    print(f"  model state per rank, 2 ranks / 1 rank: {ratio:.3f}")


if __name__ == "__main__":
    main()
