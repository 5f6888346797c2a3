"""Chunked cross entropy (`chunk_loss_size`) vs the full-logits loss: peak memory and time of forward+backward.

Each variant runs in its own subprocess so its peak RSS is its own (CPU); on an accelerator the allocator's
peak is read instead. Prints the figures and the ratios chunked / full, measured in the same run.
Run: python benchmarks/bench_chunked_loss.py [--tokens 4096 --hidden 256 --vocab 32000 --chunk 512]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _measure(tokens: int, hidden: int, vocab: int, chunk: int, device: str, repeats: int) -> dict:
    import torch

    from fsdp2_backend.training.logging import peak_memory_bytes
    from fsdp2_backend.training.loss import chunked_masked_loss_sum, masked_loss_sum

    torch.manual_seed(0)
    dev = torch.device(device)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev)
    h = torch.randn(1, tokens, hidden, device=dev, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens), device=dev)
    mask = torch.ones(1, tokens, device=dev)
    base = peak_memory_bytes(dev)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        if chunk:
            loss, _ = chunked_masked_loss_sum(h, head, labels, mask, chunk)
        else:
            loss, _ = masked_loss_sum(head(h), labels, mask)
        loss.backward()
        times.append(time.perf_counter() - start)
        h.grad = None
        head.weight.grad = None
    return {"peak_bytes": peak_memory_bytes(dev), "base_bytes": base, "step_s": min(times), "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_measure(args.tokens, args.hidden, args.vocab, args.child, args.device, args.repeats)))
        return
    results = {}
    for name, chunk in (("full", 0), ("chunked", args.chunk)):
        cmd = [sys.executable, __file__, "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab",
               str(args.vocab), "--device", args.device, "--repeats", str(args.repeats), "--child", str(chunk)]
        results[name] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} chunk={args.chunk} device={args.device} "
          f"(fp32 logits of the full batch: {logits_mib:.0f} MiB)")
    for name, r in results.items():
        growth = (r["peak_bytes"] - r["base_bytes"]) / 2**20
        print(f"{name:8s} peak {r['peak_bytes'] / 2**20:8.1f} MiB (above start {growth:7.1f})"
              f"  step {r['step_s'] * 1000:8.1f} ms  loss {r['loss']:.6f}")
    full, chunked = results["full"], results["chunked"]
    grow = lambda r: max(r["peak_bytes"] - r["base_bytes"], 1)  # noqa: E731
    print(f"ratio chunked/full: peak growth {grow(chunked) / grow(full):.2f}, "
          f"time {chunked['step_s'] / full['step_s']:.2f}")


if __name__ == "__main__":
    main()
