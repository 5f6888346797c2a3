"""SFT data path figures: preprocessing throughput with packing, and the attention memory of neat packing.

1. Preprocessing (`prepare_datasets`: read jsonl → alpaca → qwen3 template → labels → greedy-knapsack packing) of
   an N-sample alpaca set (default 50 000, drawn from local text) with a Qwen3-like tokenizer: samples/s and
   tokens/s, and the ratio to the tokenizer's own batch encoding of the same texts (the floor of any pipeline),
   measured in the same run.
2. Attention of one packed row of S tokens (documents of 256..2048 tokens, 8 heads of 64): the packed attention
   (per-document, no mask; `models/packed_attention.py`) vs SDPA with the dense [1, 1, S, S] bf16 block mask
   MindSpeed builds. Each case runs in its own subprocess; its peak memory above the inputs (the polled peak of
   the resident set on CPU, the allocator's peak on an accelerator) is the figure. The dense case at 32k needs ~10 GiB
   on CPU: it runs only with --allow-large (the mask alone is S² x 2 bytes, printed always).
Run: python benchmarks/bench_sft_data.py [--samples 50000] [--cutoffs 8192,32768] [--allow-large]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time



def preprocessing(samples: int, cutoff: int, workers: int) -> dict:
    from fsdp2_backend.config import Config, DataArguments, TrainingArguments
    from fsdp2_backend.data.sft.pipeline import prepare_datasets
    from tests.sft_assets import alpaca_rows, qwen3_like_tokenizer, write_jsonl

    root = tempfile.mkdtemp(prefix="bench_sft_")
    tokenizer = qwen3_like_tokenizer(os.path.join(root, "tok"), vocab_size=2000)
    rows = alpaca_rows(samples)
    path = write_jsonl(os.path.join(root, "alpaca.jsonl"), rows)
    texts = [r["instruction"] + "\n" + r["input"] + r["output"] for r in rows]
    import datasets  # noqa: F401  (imported before the clock starts)
    start = time.perf_counter()
    tokenizer(texts, add_special_tokens=False)
    encode_s = time.perf_counter() - start
    config = Config(data=DataArguments(dataset={"file_name": path}, template="qwen3", cutoff_len=cutoff,
                                       packing=True, preprocessing_num_workers=workers, overwrite_cache=True),
                    training=TrainingArguments(stage="sft", max_steps=1))
    start = time.perf_counter()
    train = prepare_datasets(config, tokenizer)["train"]
    tokens = sum(sum(lens) for lens in train["doc_lens"])
    seconds = time.perf_counter() - start
    return {"samples": samples, "rows": len(train), "tokens": tokens, "seconds": seconds,
            "samples_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "tokenizer_only_samples_per_s": samples / encode_s, "ratio_vs_tokenizer": encode_s / seconds}


def _doc_positions(seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    lens, total = [], 0
    while total < seq:
        n = min(int(torch.randint(256, 2049, (1,), generator=gen)), seq - total)
        lens.append(n)
        total += n
    return torch.cat([torch.arange(n) for n in lens]).unsqueeze(0), lens


def attention_case(kind: str, seq: int, device: str) -> dict:
    import torch
    import torch.nn.functional as F

    from fsdp2_backend.models.packed_attention import packed_attention
    from fsdp2_backend.training.logging import peak_memory_bytes

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type != "cpu" else torch.float32
    heads, dim = 8, 64
    positions, lens = _doc_positions(seq)
    q, k, v = (torch.randn(1, heads, seq, dim, device=dev, dtype=dtype) for _ in range(3))
    positions = positions.to(dev)
    sampler = _RssSampler() if dev.type == "cpu" else None
    base = sampler.start() if sampler else peak_memory_bytes(dev)
    start = time.perf_counter()
    if kind == "neat":
        packed_attention(None, q, k, v, None, scaling=dim ** -0.5, position_ids=positions)
    else:
        doc = (positions == 0).cumsum(-1)
        mask = ((doc[:, :, None] == doc[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool, device=dev).tril())
        dense = torch.zeros(1, 1, seq, seq, dtype=torch.bfloat16, device=dev).masked_fill_(~mask[:, None],
                                                                                          float("-inf"))
        del mask
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense.to(dtype), scale=dim ** -0.5)
    seconds = time.perf_counter() - start
    peak = sampler.stop() if sampler else peak_memory_bytes(dev)
    return {"kind": kind, "seq": seq, "docs": len(lens), "peak_bytes": peak - base, "seconds": seconds}


class _RssSampler:
    """Peak of the process's current resident set (/proc/self/statm), polled every millisecond by a thread:
    the high-water mark getrusage keeps is already set by the imports, so it cannot show a later peak."""

    def __init__(self):
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.peak, self.running = 0, False
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _poll(self) -> None:
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.001)

    def start(self) -> int:
        base = self._rss()
        self.peak, self.running = base, True
        self.thread.start()
        return base

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, self._rss())


def _subprocess(kind: str, seq: int, device: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--case", kind, str(seq), device], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode:
        return {"kind": kind, "seq": seq, "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--cutoff", type=int, default=4096, help="cutoff_len of the preprocessing figure")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cutoffs", default="8192,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--allow-large", action="store_true")
    parser.add_argument("--skip-preprocessing", action="store_true")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(attention_case(args.case[0], int(args.case[1]), args.case[2])))
        return
    if not args.skip_preprocessing:
        p = preprocessing(args.samples, args.cutoff, args.workers)
        print(f"preprocessing {p['samples']} alpaca samples (qwen3 template, packing into {args.cutoff}, "
              f"{args.workers} worker): {p['seconds']:.1f} s, {p['samples_per_s']:.0f} samples/s, "
              f"{p['tokens_per_s']:.0f} tokens/s, {p['rows']} packed rows of {p['tokens']} tokens; tokenizer "
              f"alone {p['tokenizer_only_samples_per_s']:.0f} samples/s (pipeline/tokenizer speed "
              f"{p['ratio_vs_tokenizer']:.2f})")
    for seq in (int(s) for s in args.cutoffs.split(",")):
        neat = _subprocess("neat", seq, args.device)
        line = f"attention S={seq}: mask alone {seq * seq * 2 / 2**20:.0f} MiB (bf16); neat packing peak "
        line += f"{neat.get('peak_bytes', 0) / 2**20:.0f} MiB ({neat.get('docs')} docs, {neat.get('seconds', 0):.2f} s)"
        if seq <= 8192 or args.allow_large or args.device != "cpu":
            dense = _subprocess("dense", seq, args.device)
            if "peak_bytes" in dense:
                ratio = dense["peak_bytes"] / max(neat["peak_bytes"], 1)
                line += (f"; dense mask peak {dense['peak_bytes'] / 2**20:.0f} MiB ({dense['seconds']:.2f} s); "
                         f"dense / neat memory {ratio:.1f}x")
            else:
                line += f"; dense mask failed: {dense['error']}"
        else:
            line += "; dense mask case skipped on CPU (needs ~10 GiB: --allow-large)"
        print(line)


if __name__ == "__main__":
    main()
