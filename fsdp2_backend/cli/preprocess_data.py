"""Megatron-LM's `tools/preprocess_data.py`, same flags and same output bytes, faster.

    python tools/preprocess_data.py --input 'data/*.jsonl' --output-prefix out/corpus \
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model ./tokenizer --append-eod --workers 8

writes out/corpus_text_document.bin/.idx. MindSpeed-LLM's `--tokenizer-type PretrainedFromHF
--tokenizer-name-or-path DIR --handler-name GeneralPretrainHandler` spelling works too. The work is done by
`megatron_compat.data.preprocess.preprocess_files`; this file only parses flags and reports errors.
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures.process import BrokenProcessPool


from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_compat.data.tokenizer import TOKENIZER_TYPES  # noqa: E402

PRETRAIN_HANDLERS = ("GeneralPretrainHandler",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="HF tokenizer directory or SentencePiece model file")
    group.add_argument("--tokenizer-name-or-path", help="HF tokenizer directory (MindSpeed's PretrainedFromHF)")
    group.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json")
    group.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size (without eod); TikTokenizer "
                                                      "vocabulary size (default 131072)")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer pre-tokenizer regex (v2)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens before the BPE ranks")
    group.add_argument("--tokenizer-special-tokens", nargs="+", dest="special_tokens",
                       help="TikTokenizer special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>)")
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: add the tokenizer's special tokens (e.g. BOS) to each text")
    group.add_argument("--tokenizer-not-use-fast", action="store_true", help="(MindSpeed) load the slow HF tokenizer")
    group.add_argument("--no-fast-path", action="store_true",
                       help="never use the tiktoken fast paths (byte-level BPE, SentencePiece BPE); "
                            "tokenize with the reference tokenizer")
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, help="input .jsonl/.jsonl.gz/.parquet file or glob")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each record")
    group.add_argument("--split-sentences", action="store_true", help="split documents into sentences (NLTK)")
    group.add_argument("--keep-newlines", action="store_true", help="keep newlines between split sentences")
    group.add_argument("--handler-name", default="GeneralPretrainHandler", help="(MindSpeed) only pretraining")
    group = parser.add_argument_group("tokenization process")
    group.add_argument("--append-eod", action="store_true", help="append the eod token to each document")
    group.add_argument("--lang", default="english", help="NLTK punkt language for --split-sentences")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="output path without _{key}_{level}.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="worker processes")
    group.add_argument("--partitions", type=int, default=1, help="Megatron's input partitions (output order)")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="keep input order with --partitions > 1")
    group.add_argument("--log-interval", type=int, default=1000, help="documents between progress lines")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    # the workers are the parallelism; the tokenizers library's own threads would only oversubscribe
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with exit_on_usage_error():
        if args.handler_name not in PRETRAIN_HANDLERS:
            raise UsageError(f"--handler-name: {args.handler_name} is not supported — this tool writes "
                             "pretraining data (GeneralPretrainHandler); instruction data is read by the "
                             "trainer's SFT pipeline")
        from megatron_compat.data.preprocess import preprocess_files
        from megatron_compat.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                                    tokenizer_name_or_path=args.tokenizer_name_or_path,
                                    vocab_file=args.vocab_file, merge_file=args.merge_file,
                                    vocab_size=args.vocab_size, trust_remote_code=args.trust_remote_code,
                                    use_fast=not args.tokenizer_not_use_fast,
                                    include_special_tokens=args.tokenizer_hf_include_special_tokens or None,
                                    tiktoken_pattern=args.tiktoken_pattern,
                                    tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                                    special_tokens=args.special_tokens)
        try:
            preprocess_files(args.input, args.output_prefix, json_keys=args.json_keys, tokenizer=tokenizer,
                             append_eod=args.append_eod, workers=args.workers,
                             split_sentences=args.split_sentences, keep_newlines=args.keep_newlines,
                             lang=args.lang, partitions=args.partitions,
                             keep_sequential_samples=args.keep_sequential_samples,
                             log_interval=args.log_interval, fast=not args.no_fast_path)
        except BrokenProcessPool as exc:
            print(f"error: a preprocessing worker died ({exc}) — check memory limits; nothing was written",
                  file=sys.stderr)
            raise SystemExit(1) from None


if __name__ == "__main__":
    main()
