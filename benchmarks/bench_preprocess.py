"""Preprocessing throughput: ours vs Megatron-LM's algorithm, same corpus, same tokenizer, same run.

Builds a JSONL corpus of real local text (Python's standard library sources, repeated to reach --mb MB),
trains a byte-level BPE tokenizer (--vocab, 32k by default), then times
  - Megatron's algorithm: `multiprocessing.Pool(workers).imap(encode, lines, 32)` tokenizing one document
    per call and megatron-core's IndexedDatasetBuilder (what Megatron-LM's tools/preprocess_data.py does;
    megatron-core is the reference, used here only);
  - ours: `preprocess_files(..., workers)` (a tiktoken fast path: byte-level BPE, or SentencePiece BPE via
    fast_spm), and with --hf-too the HF-tokenizer path;
checks that the outputs are byte-identical and prints the throughput ratios.

Each run is a fresh process timed from its start to its exit, imports included, as a user runs it: ours is
`tools/preprocess_data.py` itself, Megatron's algorithm a child of this script (its imports: transformers'
AutoTokenizer and megatron-core's builder, which bring torch). `--repeats` rounds alternate the two (this
machine is shared: both see the same load); the best wall time of each counts.

    python benchmarks/bench_preprocess.py --mb 100 --workers 2 --repeats 2
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_corpus(path: Path, megabytes: float) -> int:
    """Writes stdlib sources as {"text": ...} lines until `megabytes`; returns the document count."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    target, written, docs = megabytes * 1e6, 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for source in files:
                line = json.dumps({"text": source.read_text(encoding="utf-8", errors="replace")}) + "\n"
                out.write(line)
                written += len(line)
                docs += 1
                if written >= target:
                    break
    return docs


class _MegatronEncoder:
    """Megatron-LM's Encoder: a tokenizer per worker, one `tokenizer(text).input_ids` per document (legacy
    Megatron-LM's _HuggingFaceTokenizer.tokenize; megatron-core 0.16.1's tokenize()+convert_tokens_to_ids
    gives the same ids for this tokenizer but is slower, so this is the stronger reference)."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer_dir = tokenizer_dir

    def initializer(self):
        _MegatronEncoder.tokenize, _MegatronEncoder.eod, _ = reference_tokenizer(self.tokenizer_dir)

    def encode(self, line):
        text = json.loads(line)["text"]
        ids = _MegatronEncoder.tokenize(text)
        lens = [len(ids)] if ids else []
        if ids:
            ids.append(_MegatronEncoder.eod)
            lens[-1] += 1
        return ids, lens, len(line)


def reference_tokenizer(path: str):
    """(tokenize, eod, vocab size) as Megatron calls them: HF `tokenizer(text).input_ids` for a tokenizer
    directory, SentencePiece `encode_as_ids` for a .model file."""
    if path.endswith(".model"):
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=path)
        return sp.encode_as_ids, sp.eos_id(), sp.get_piece_size()
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    return (lambda text: hf(text).input_ids), hf.eos_token_id, len(hf)


def run_megatron(corpus: Path, tokenizer_dir: str, prefix: str, workers: int) -> None:
    """Megatron-LM's process_json_file: Pool.imap(encode, lines, 32) into megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    encoder = _MegatronEncoder(tokenizer_dir)
    vocab_size = reference_tokenizer(tokenizer_dir)[2]
    builder = IndexedDatasetBuilder(prefix + "_text_document.bin", dtype=DType.optimal_dtype(vocab_size))
    with open(corpus, encoding="utf-8") as fin, multiprocessing.Pool(workers, encoder.initializer) as pool:
        for ids, lens, _ in pool.imap(encoder.encode, fin, 32):
            builder.add_document(ids, lens)
    builder.finalize(prefix + "_text_document.idx")


def ours_command(corpus: Path, tokenizer_dir: str, prefix: str, workers: int, fast: bool) -> list:
    """tools/preprocess_data.py's command line for this corpus and tokenizer."""
    kind = "SentencePieceTokenizer" if tokenizer_dir.endswith(".model") else "HuggingFaceTokenizer"
    return [sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "preprocess_data.py"),
            "--input", str(corpus), "--output-prefix", prefix, "--tokenizer-type", kind,
            "--tokenizer-model", tokenizer_dir, "--append-eod", "--workers", str(workers),
            "--log-interval", str(10**9), *([] if fast else ["--no-fast-path"])]


def megatron_command(corpus: Path, tokenizer_dir: str, prefix: str, workers: int) -> list:
    return [sys.executable, __file__, "--megatron-child", str(corpus), tokenizer_dir, prefix, str(workers)]


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the workers): robust to a shared machine."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(command: list):
    """(wall seconds, CPU seconds) of a fresh process running `command`, its workers included."""
    cpu, wall = cpu_seconds(), time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - wall, cpu_seconds() - cpu


def same_output(a: str, b: str) -> bool:
    return all(Path(a + ext).read_bytes() == Path(b + ext).read_bytes()
               for ext in ("_text_document.bin", "_text_document.idx"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0, help="corpus size in MB")
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size")
    parser.add_argument("--train-mb", type=float, default=8.0, help="MB of the corpus the tokenizer trains on")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--hf-too", action="store_true", help="also time our HF-tokenizer (no fast path) run")
    parser.add_argument("--tokenizer", choices=("bytelevel", "sentencepiece"), default="bytelevel")
    parser.add_argument("--repeats", type=int, default=2, help="rounds alternating the runs (best wall time)")
    parser.add_argument("--megatron-child", nargs=4, metavar=("CORPUS", "TOKENIZER", "PREFIX", "WORKERS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.megatron_child:
        corpus, tok, prefix, workers = args.megatron_child
        run_megatron(Path(corpus), tok, prefix, int(workers))
        return
    from fsdp2_backend.cli.demo_assets import train_bytelevel_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp, "corpus.jsonl")
        docs = build_corpus(corpus, args.mb)
        size_mb = corpus.stat().st_size / 1e6
        sample, taken = [], 0
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                sample.append(json.loads(line)["text"])
                taken += len(line)
                if taken > args.train_mb * 1e6:
                    break
        start = time.perf_counter()
        if args.tokenizer == "bytelevel":
            train_bytelevel_tokenizer(Path(tmp, "tok"), vocab_size=args.vocab, texts=sample)
            tok = str(Path(tmp, "tok"))
        else:
            import sentencepiece

            lines = (line for text in sample for line in text.splitlines() if line.strip())
            sentencepiece.SentencePieceTrainer.train(sentence_iterator=lines, model_prefix=str(Path(tmp, "sp")),
                                                     vocab_size=args.vocab, model_type="bpe", minloglevel=2)
            tok = str(Path(tmp, "sp.model"))
        print(f"corpus: {docs} documents, {size_mb:.1f} MB; tokenizer: {args.tokenizer} {args.vocab} "
              f"(trained in {time.perf_counter() - start:.1f} s); workers: {args.workers}")
        runs = ([("ours, tiktoken fast path", True)] + ([("ours, HF tokenizer", False)] if args.hf_too else [])
                if args.tokenizer == "bytelevel" else [("ours, SentencePiece", True)])
        ref = str(Path(tmp, "ref"))
        commands = {"megatron": megatron_command(corpus, tok, ref, args.workers)}
        for name, fast in runs:
            commands[name] = ours_command(corpus, tok, str(Path(tmp, "fast" if fast else "hf")), args.workers, fast)
        times = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, command in commands.items():
                times[name].append(timed(command))
        t_ref, c_ref = min(t for t, _ in times["megatron"]), min(c for _, c in times["megatron"])
        print(f"{'megatron algorithm (Pool.imap chunksize 32, per-doc call):':58s} {t_ref:7.2f} s "
              f"{size_mb / t_ref:6.2f} MB/s  cpu {c_ref:7.2f} s")
        for name, fast in runs:
            t, c = min(t for t, _ in times[name]), min(c for _, c in times[name])
            prefix = str(Path(tmp, "fast" if fast else "hf"))
            print(f"{name + ':':58s} {t:7.2f} s {size_mb / t:6.2f} MB/s  cpu {c:7.2f} s  speed-up x{t_ref / t:.2f} "
                  f"(cpu x{c_ref / c:.2f})  byte-identical: {same_output(prefix, ref)}")
        print("wall times (s), per round: " + "; ".join(
            f"{name}: {', '.join(f'{t:.2f}' for t, _ in values)}" for name, values in times.items()))


if __name__ == "__main__":
    main()
