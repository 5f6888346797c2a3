"""SFT data path figures: preprocessing throughput with packing, and the attention memory of neat packing.

1. Preprocessing (`prepare_datasets`: read jsonl → alpaca → qwen3 template → labels → greedy-knapsack packing) of
   an N-sample alpaca set (default 50 000, drawn from local text) with a Qwen3-like tokenizer, per
   `preprocessing_num_workers` (--workers), next to the tokenizer's own batch encoding, `tokenizer(texts)`, of
   the same samples rendered by its chat template (the floor of any pipeline; its Rust backend alone is printed
   too) and, with --llamafactory-python, LLaMA-Factory's own preprocessing (`get_dataset`, template qwen3,
   packing) of the same file, all measured in the same rounds, each in a fresh process: samples/s by CPU time
   (the process and its workers; the steadier figure on a shared machine) and by wall time; with several worker
   counts, our CPU time per sample split between the main process and the workers, the cores kept busy (CPU / wall)
   and the wall speed-up. The Rust tokenizer batch-encodes on every core of its own accord, so one worker already
   keeps more than one core busy and the wall speed-up of more workers is bounded by the cores left idle;
   --tokenizer-threads off (TOKENIZERS_PARALLELISM=false in every measured process) shows the split alone, each
   process on one core.
   LLaMA-Factory lives in an environment of its own, never the project's: e.g. `python -m venv /root/bench-lf`, a
   .pth file naming the project venv's site-packages (the same torch / transformers / datasets), `pip install --no-deps
   llamafactory==0.9.5 peft omegaconf`, and an empty `torchaudio` package (0.9.5 imports it at module level and
   no build exists for torch 2.13; text SFT never calls it); DISABLE_VERSION_CHECK=1 is set for it.
2. Attention of one packed row of S tokens (documents of 256..2048 tokens, 8 heads of 64): the packed attention
   (per-document, no mask; `models/packed_attention.py`) vs SDPA with the dense [1, 1, S, S] bf16 block mask
   MindSpeed builds. Each case runs in its own subprocess; its peak memory above the inputs (the polled peak of
   the resident set on CPU, the allocator's peak on an accelerator) is the figure. The dense case at 32k needs ~10 GiB
   on CPU: it runs only with --allow-large (the mask alone is S² x 2 bytes, printed always).
Run: python -m benchmarks.bench_sft_data [--samples 50000] [--workers 1,2] [--rounds 3] [--tokenizer-threads off]
         [--llamafactory-python /root/bench-lf/bin/python] [--cutoffs 8192,32768] [--allow-large]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time



def _clocks():
    """(CPU seconds of this process (all its threads), CPU seconds of its finished children, wall seconds)."""
    times = os.times()
    return times.user + times.system, times.children_user + times.children_system, time.perf_counter()


def _since(mark) -> dict:
    """CPU seconds since `mark` (all processes; `main`: this process alone), wall seconds."""
    main, children, wall = (now - then for now, then in zip(_clocks(), mark))
    return {"cpu": main + children, "main": main, "wall": wall}


def preprocessing_inputs(samples: int) -> str:
    """A folder holding the alpaca jsonl (and LLaMA-Factory's dataset_info.json for it) and the tokenizer."""
    from tests.support.sft_assets import alpaca_rows, qwen3_like_tokenizer, write_jsonl

    root = tempfile.mkdtemp(prefix="bench_sft_")
    qwen3_like_tokenizer(os.path.join(root, "tok"), vocab_size=2000)
    write_jsonl(os.path.join(root, "alpaca.jsonl"), alpaca_rows(samples))
    with open(os.path.join(root, "dataset_info.json"), "w") as f:
        json.dump({"alpaca_bench": {"file_name": "alpaca.jsonl"}}, f)
    return root


def _rendered_texts(tokenizer, root: str) -> list:
    """Each sample as the tokenizer's own chat template (Qwen3's jinja) renders it: the text the pipeline
    tokenizes (the same characters: the prompt, the empty thought block, the reply), rendered before any clock."""
    with open(os.path.join(root, "alpaca.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    conversations = [[{"role": "user", "content": "\n".join(t for t in (r["instruction"], r["input"]) if t)},
                      {"role": "assistant", "content": r["output"]}] for r in rows]
    return [tokenizer.apply_chat_template(messages, tokenize=False) for messages in conversations]


def tokenizer_only(root: str, backend: bool = False) -> dict:
    """The bare batched tokenizer, `tokenizer(texts)`, on the rendered samples: the floor of any pipeline.
    `backend`: the fast tokenizer's Rust backend alone (`encode_batch_fast`, ids only), a lower floor still."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "tok"))
    texts = _rendered_texts(tokenizer, root)
    mark = _clocks()
    if backend:
        [encoding.ids for encoding in tokenizer._tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    else:
        tokenizer(texts, add_special_tokens=False)
    return {"samples": len(texts), **_since(mark)}


def preprocessing(root: str, cutoff: int, workers: int) -> dict:
    from transformers import AutoTokenizer

    from fsdp2_backend.config import Config, DataArguments, TrainingArguments
    from fsdp2_backend.data.sft.pipeline import prepare_datasets

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "tok"))
    import datasets  # noqa: F401  (imported before the clock starts)
    config = Config(data=DataArguments(dataset={"file_name": os.path.join(root, "alpaca.jsonl")}, template="qwen3",
                                       cutoff_len=cutoff, packing=True, preprocessing_num_workers=workers,
                                       overwrite_cache=True),
                    training=TrainingArguments(stage="sft", max_steps=1))
    mark = _clocks()
    train = prepare_datasets(config, tokenizer)["train"]
    return {"rows": len(train), **_since(mark), "tokens": sum(sum(lens) for lens in train["doc_lens"])}


def llamafactory_preprocessing(root: str, cutoff: int, workers: int) -> dict:
    """LLaMA-Factory's own SFT preprocessing (get_dataset: load, align, template qwen3, packing) of the same
    file; runs in the interpreter given by --llamafactory-python (its own environment)."""
    os.environ.setdefault("DISABLE_VERSION_CHECK", "1")  # it pins older transformers; the data path runs as is
    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, ModelArguments
    from transformers import AutoTokenizer, Seq2SeqTrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(root, "tok"))
    model_args = ModelArguments(model_name_or_path=os.path.join(root, "tok"))
    data_args = DataArguments(template="qwen3", dataset="alpaca_bench", dataset_dir=root, cutoff_len=cutoff,
                              packing=True, preprocessing_num_workers=workers if workers > 1 else None,
                              overwrite_cache=True)
    training_args = Seq2SeqTrainingArguments(output_dir=os.path.join(root, "lf_out"), do_train=True,
                                             report_to=[])
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    mark = _clocks()
    train = get_dataset(template, model_args, data_args, training_args, "sft", tokenizer)["train_dataset"]
    return {"rows": len(train), **_since(mark)}


def _preprocessing_child(kind: str, root: str, cutoff: int, workers: int, python: str = sys.executable) -> dict:
    """One measurement in a fresh process (no warm caches, imports outside the clock)."""
    out = subprocess.run([python, __file__, "--preprocess", kind, root, str(cutoff), str(workers)],
                         capture_output=True, text=True, timeout=3600, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))), env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                               "PYTHONPATH": os.path.dirname(os.path.dirname(
                                                                   os.path.abspath(__file__)))})
    if out.returncode:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


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


def preprocessing_figures(args) -> None:
    """Rounds alternate the bare tokenizer, its backend alone, ours and LLaMA-Factory, each in a fresh process;
    medians of CPU seconds (the process and its worker processes: the steadier figure on a shared machine) and of
    wall seconds. Scaling in preprocessing_num_workers: CPU per sample (a split that scales keeps it flat: the
    work divides, nothing is done twice) and how much of it the worker processes carry; wall speed-up over 1."""
    import statistics

    root = preprocessing_inputs(args.samples)
    print(f"preprocessing {args.samples} alpaca samples (qwen3 template, packing into {args.cutoff}), median of "
          f"{args.rounds} alternating rounds, each in a fresh process; samples/s by CPU time [by wall time]; the "
          f"references tokenize the same samples rendered by the tokenizer's chat template:", flush=True)
    ours_by_workers = {}
    for workers in (int(w) for w in args.workers.split(",")):
        kinds = ["tokenizer", "backend", "ours"] + (["llamafactory"] if args.llamafactory_python else [])
        runs = {kind: [] for kind in kinds}
        for _ in range(args.rounds):
            for kind in kinds:
                python = args.llamafactory_python if kind == "llamafactory" else sys.executable
                runs[kind].append(_preprocessing_child(kind, root, args.cutoff, workers, python))
        medians = {}
        for kind, results in runs.items():
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                print(f"  {kind}: failed: {errors[0]}")
                continue
            medians[kind] = {clock: statistics.median(r[clock] for r in results) for clock in ("cpu", "main", "wall")}
        rate = {kind: (args.samples / m["cpu"], args.samples / m["wall"]) for kind, m in medians.items()}
        if "ours" not in rate or "tokenizer" not in rate:
            continue
        ours, tok = rate["ours"], rate["tokenizer"]
        line = (f"  {workers} worker(s): bare tokenizer(texts) {tok[0]:6.0f} [{tok[1]:6.0f}]; ours {ours[0]:6.0f} "
                f"[{ours[1]:6.0f}] = {ours[0] / tok[0]:.2f}x [{ours[1] / tok[1]:.2f}x] the bare tokenizer")
        if "backend" in rate:
            line += f" ({ours[0] / rate['backend'][0]:.2f}x its Rust backend alone, {rate['backend'][0]:6.0f})"
        if "llamafactory" in rate:
            lf = rate["llamafactory"]
            line += (f"; LLaMA-Factory {lf[0]:6.0f} [{lf[1]:6.0f}], ours / LLaMA-Factory {ours[0] / lf[0]:.2f}x "
                     f"[{ours[1] / lf[1]:.2f}x]")
        print(line, flush=True)
        ours_by_workers[workers] = medians["ours"]
    if len(ours_by_workers) > 1:
        print("  scaling of ours (CPU time per sample is the evidence on a shared machine; wall needs idle cores):")
        base_workers = min(ours_by_workers)
        base = ours_by_workers[base_workers]
        for workers, m in sorted(ours_by_workers.items()):
            main, children = (1e6 * m[k] / args.samples for k in ("main", "cpu"))
            children -= main
            print(f"    {workers} worker(s): {main + children:5.0f} us CPU per sample ({m['cpu'] / base['cpu']:.2f}x of "
                  f"{base_workers} worker(s)): the main process {main:4.0f} us, the worker processes {children:4.0f} "
                  f"us per sample they encode; {m['cpu'] / m['wall']:.2f} cores busy; wall speed-up "
                  f"{base['wall'] / m['wall']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--cutoff", type=int, default=4096, help="cutoff_len of the preprocessing figure")
    parser.add_argument("--workers", default="1,2", help="preprocessing_num_workers values, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per figure (median)")
    parser.add_argument("--llamafactory-python", default=None,
                        help="a Python with LLaMA-Factory installed (its own venv): its preprocessing of the same "
                             "data and template is measured in the same rounds")
    parser.add_argument("--tokenizer-threads", choices=("on", "off"), default="on",
                        help="off: TOKENIZERS_PARALLELISM=false in every measured process (one core each)")
    parser.add_argument("--cutoffs", default="8192,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--allow-large", action="store_true")
    parser.add_argument("--skip-preprocessing", action="store_true")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--preprocess", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(attention_case(args.case[0], int(args.case[1]), args.case[2])))
        return
    if args.preprocess:
        kind, root, cutoff, workers = args.preprocess
        run = {"tokenizer": lambda: tokenizer_only(root), "backend": lambda: tokenizer_only(root, backend=True),
               "ours": lambda: preprocessing(root, int(cutoff), int(workers)),
               "llamafactory": lambda: llamafactory_preprocessing(root, int(cutoff), int(workers))}[kind]
        print(json.dumps(run()))
        return
    if not args.skip_preprocessing:
        if args.tokenizer_threads == "off":  # inherited by every measured process
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
        preprocessing_figures(args)
    for seq in (int(s) for s in args.cutoffs.split(",") if s):
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
