"""Megatron-LM's `tools/merge_datasets.py`: the same flags, the same output bytes.

    python tools/merge_datasets.py --input shards/ --output-prefix merged/corpus_text_document [--multimodal]

merges every `.bin/.idx` pair in the `--input` folder, in sorted prefix order, into OUTPUT_PREFIX.bin/.idx
(the token dtype of the first; all must share it). As Megatron's: a file's prefix is its name without the
last extension, every prefix must have both files, sub-folders are passed over. Ours: each problem is one
line (exit 2) instead of an AssertionError, and the output is written under temporary names and renamed, so
a failed merge leaves nothing half-written.
"""
from __future__ import annotations

import argparse
import os
import sys


from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to directory containing all document files to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true", help="Whether the datasets are assumed to be multimodal")
    return parser


def dataset_prefixes(folder: str):
    """The sorted prefixes of the pairs in `folder` (Megatron's rule); UsageError for a file without its pair."""
    prefixes = set()
    for name in os.listdir(folder):
        prefix, ext = os.path.splitext(name)
        if prefix in prefixes or not os.path.isfile(os.path.join(folder, name)):
            continue
        pair = ".bin" if ext == ".idx" else ".idx"
        if not os.path.isfile(os.path.join(folder, prefix) + pair):
            raise UsageError(f"--input: {os.path.join(folder, name)} has no {pair} file beside it — every file "
                             "in the folder must belong to a .bin/.idx pair")
        prefixes.add(prefix)
    return sorted(prefixes)


def merge(folder: str, output_prefix: str, multimodal: bool = False) -> None:
    from fsdp2_backend.checkpoint.atomic import publish
    from megatron_compat.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, get_bin_path,
                                                      get_idx_path)

    if not os.path.isdir(folder):
        raise UsageError(f"--input: {folder} is not a directory or does not exist — give the folder of the "
                         ".bin/.idx pairs to merge")
    out_dir = os.path.dirname(output_prefix)
    if not os.path.isdir(out_dir or "."):
        raise UsageError(f"--output-prefix: {out_dir} is not a directory or does not exist — create it first")
    prefixes = [os.path.join(folder, p) for p in dataset_prefixes(folder)]
    if not prefixes:
        raise UsageError(f"--input: {folder} holds no .bin/.idx pairs — nothing to merge")
    dtype = IndexedDataset(prefixes[0], multimodal=multimodal).index.dtype  # also checks the first pair
    bin_tmp, idx_tmp = get_bin_path(output_prefix) + ".partial", get_idx_path(output_prefix) + ".partial"
    builder = IndexedDatasetBuilder(bin_tmp, dtype=dtype, multimodal=multimodal)
    try:
        for prefix in prefixes:
            IndexedDataset(prefix, multimodal=multimodal)  # the open-time checks, naming a broken file
            builder.add_index(prefix)
        builder.finalize(idx_tmp)
    except BaseException:
        builder.data_file.close()
        for tmp in (bin_tmp, idx_tmp):
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    publish(bin_tmp, get_bin_path(output_prefix))  # fsync'd, then renamed: a crash leaves no half-written pair
    publish(idx_tmp, get_idx_path(output_prefix))


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    with exit_on_usage_error():
        merge(args.input, args.output_prefix, args.multimodal)


if __name__ == "__main__":
    main()
