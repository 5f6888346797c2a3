#!/usr/bin/env python
"""Host memory of the HF export per rank, against the model's size, at 1, 2 and 4 gloo/CPU ranks.

    python benchmarks/bench_hf_export.py [--ranks 1 2 4] [--layers 8] [--hidden 512]

Each rank shards a Qwen3 (fp32) with FSDP2 and runs one of two exports, each in processes of its own:
ours (`export_hf`: every rank gathers and writes a shard of whole layers) and, as the reference measured in the
same run, the whole state dict gathered on rank 0 and written by `save_pretrained` (what the export did before,
and what a gather-on-one-host export does). A sampling thread reads each rank's resident memory (VmRSS) every
2 ms; the figure is the peak during the export minus the resident memory just before it (the model's own
shards, libraries). Ours must fall with the ranks (about model / ranks plus one layer in flight); the
reference stays at the model's size on rank 0. CPU and page-cache noise: a few MB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 2 ** 20


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """The highest VmRSS seen while the block runs, sampled by a thread."""

    def __enter__(self):
        self.before, self.peak, self._stop = _rss(), _rss(), threading.Event()

        def sample():
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss())
                time.sleep(0.002)
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _gather_on_rank0(model, out_dir: Path) -> None:
    """The reference: the full state dict on rank 0 (cpu_offload), written there by save_pretrained."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(str(out_dir), state_dict=state)
    del state
    dist.barrier()


def _worker(rank, world_size, which, layers, hidden, workdir, out_json):
    import gc

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from fsdp2_backend.checkpoint.hf_export import export_hf
    from tests.support.tiny_models import tiny_qwen3_config

    torch.set_num_threads(1)
    config = tiny_qwen3_config(vocab_size=8192, hidden_size=hidden, intermediate_size=3 * hidden,
                               num_hidden_layers=layers, head_dim=64, num_attention_heads=hidden // 64,
                               num_key_value_heads=hidden // 128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")  # only this rank's shards are ever allocated
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results = {"model_mb": model_bytes / MB}
    run = (lambda d: export_hf(model, d)) if which == "ours" else (lambda d: _gather_on_rank0(model, d))
    gc.collect()
    dist.barrier()
    with PeakRSS() as rss:
        run(Path(workdir) / which)
    dist.barrier()
    results[which] = (rss.peak - rss.before) / MB
    gathered = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out_json).write_text(json.dumps(gathered))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the launcher and tiny configs
    from tests.support.launchers import run_distributed

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # large blocks straight from mmap and back to the system when freed: RSS then shows what is held, not what
    # the allocator kept from an earlier gather
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    print(f"{'ranks':>5} | {'model MB':>8} | {'ours: peak extra MB per rank':>30} | "
          f"{'rank-0 gather: per rank':>30} | ours max / model")
    for ranks in args.ranks:
        rows = {}
        for which in ("ours", "rank0_gather"):  # each in processes of its own
            workdir = Path(tempfile.mkdtemp(prefix="bench_hf_export_"))
            try:
                out = workdir / "results.json"
                run_distributed(_worker, ranks, which, args.layers, args.hidden, str(workdir), str(out))
                rows[which] = json.loads(out.read_text())
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
        model = rows["ours"][0]["model_mb"]
        ours = [r["ours"] for r in rows["ours"]]
        ref = [r["rank0_gather"] for r in rows["rank0_gather"]]
        print(f"{ranks:>5} | {model:8.0f} | {' '.join(f'{v:6.0f}' for v in ours):>30} | "
              f"{' '.join(f'{v:6.0f}' for v in ref):>30} | {max(ours) / model:.2f}")


if __name__ == "__main__":
    main()
