"""Ulysses vs ring context parallel against cp 1: training-step time and peak memory per rank at a long sequence.

Runs a small real HF Qwen3 (fp32, CPU, gloo) forward+backward on one sequence of `--seq` tokens: cp 1 in one
process, then cp 2 Ulysses and cp 2 ring in two processes each. Each layout runs in fresh processes, so the
peak resident memory (ru_maxrss) of a rank belongs to that layout alone; "activation peak" subtracts the
resident memory measured just before the first step. Prints figures and ratios against cp 1.

    python -m benchmarks.bench_context_parallel --seq 4096 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank, world_size, cp_type, args, out_dir):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3ForCausalLM

    from fsdp2_backend.parallel.context_parallel.attention import enable_context_parallel
    from fsdp2_backend.parallel.context_parallel.batch import cp_token_mean, shard_batch_for_cp, shift_labels
    from tests.support.tiny_models import tiny_qwen3_config

    torch.set_num_threads(1)  # one core per rank, as on the shared 2-core machine
    torch.manual_seed(0)
    config = tiny_qwen3_config(hidden_size=args.hidden, num_attention_heads=args.heads,
                               num_key_value_heads=args.heads // 2, head_dim=args.hidden // args.heads,
                               intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                               max_position_embeddings=args.seq)
    model = Qwen3ForCausalLM(config)
    group = None
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        enable_context_parallel(model, mesh, cp_type)
        group = mesh.get_group()
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))
    batch = shard_batch_for_cp({"input_ids": ids, "labels": shift_labels(ids)}, rank, world_size, cp_type)
    baseline = _rss_mib()
    times = []
    for _ in range(args.steps + 1):  # the first step warms up and is not timed
        start = time.perf_counter()
        logits = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
        loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), reduction="sum")
        loss = cp_token_mean(loss_sum, (batch["labels"] != -100).sum(), group)
        loss.backward()
        model.zero_grad(set_to_none=True)
        del logits, loss_sum, loss
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.path.join(out_dir, f"{cp_type}-{world_size}-{rank}.json"), "w") as f:
        json.dump({"step_s": sorted(times[1:])[len(times[1:]) // 2], "peak_rss_mib": peak,
                   "activation_peak_mib": peak - baseline}, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from tests.support.launchers import run_distributed

    layouts = [("cp1", "ulysses", 1), ("cp2 ulysses", "ulysses", 2), ("cp2 ring", "ring", 2)]
    rows = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for label, cp_type, size in layouts:
            run_distributed(_worker, size, cp_type, args, out_dir)
            ranks = [json.loads(Path(out_dir, f"{cp_type}-{size}-{r}.json").read_text()) for r in range(size)]
            rows[label] = {key: max(r[key] for r in ranks) for key in ranks[0]}  # slowest / largest rank
    base = rows["cp1"]
    print(f"seq {args.seq}, hidden {args.hidden}, heads {args.heads} (kv {args.heads // 2}), layers {args.layers}, "
          f"fp32, 1 thread per rank, median of {args.steps} fwd+bwd steps; worst rank shown")
    print(f"{'layout':<13}{'step s':>9}{'x cp1':>8}{'peak RSS MiB':>14}{'act. peak MiB':>15}{'x cp1':>8}")
    for label, row in rows.items():
        print(f"{label:<13}{row['step_s']:>9.3f}{row['step_s'] / base['step_s']:>8.2f}{row['peak_rss_mib']:>14.0f}"
              f"{row['activation_peak_mib']:>15.0f}{row['activation_peak_mib'] / base['activation_peak_mib']:>8.2f}")


if __name__ == "__main__":
    main()
