#!/usr/bin/env python
"""Shows what the model sees in fine-tuning: the first rows of a config's SFT data as training consumes them (the same
preparation, tokenized_path cache included, and the same order: the training sampler's, shuffled unless
training.disable_shuffling; one data-parallel rank).

    python tools/preview_data.py CONFIG.yaml [--group.field value ...] [--num N] [--json]

Each example is printed after a `=== N ===` line as the decoded text, with the trained spans (labels that are
not ignored) between `[TRAIN]` and `[/TRAIN]`; packed rows show a `--- sample ---` line between their samples.
`--json` prints one JSON object per example instead: `input_ids`, `labels` (aligned with input_ids, -100 where not
trained) and `doc_lens` (the lengths of the samples packed in the row). The config is validated as for training
(world size 1); nothing is trained and no model is loaded, only the tokenizer.
"""
from __future__ import annotations

import json
import os
import sys
from typing import List, Optional


from fsdp2_backend.usage_errors import UsageError, exit_on_usage_error  # noqa: E402

BEGIN, END = "[TRAIN]", "[/TRAIN]"


def marked_text(hf, input_ids: List[int], labels: List[int], doc_lens: List[int]) -> str:
    """The decoded example with trained runs of tokens wrapped in BEGIN / END."""
    from fsdp2_backend.data.sft.supervised import IGNORE_INDEX

    pieces, start = [], 0
    for n, length in enumerate(doc_lens or [len(input_ids)]):
        if n:
            pieces.append("\n--- sample ---\n")
        ids, labs = input_ids[start:start + length], labels[start:start + length]
        run: List[int] = []
        trained = None
        for token, label in zip(ids + [None], labs + [None]):
            is_trained = label is not None and label != IGNORE_INDEX
            if token is None or (trained is not None and is_trained != trained):
                text = hf.decode(run)
                pieces.append(f"{BEGIN}{text}{END}" if trained else text)
                run = []
            if token is not None:
                run.append(token)
                trained = is_trained
        start += length
    return "".join(pieces)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__)
        return 0
    with exit_on_usage_error():
        num, as_json, rest = 5, False, []
        i = 0
        while i < len(argv):
            if argv[i] == "--num":
                if i + 1 == len(argv) or not argv[i + 1].isdigit():
                    raise UsageError("--num: give a number of examples, e.g. --num 3")
                num, i = int(argv[i + 1]), i + 2
                continue
            if argv[i] == "--json":
                as_json = True
            else:
                rest.append(argv[i])
            i += 1
        from fsdp2_backend.config.loading import build_config, load_yaml, split_native_overrides
        from fsdp2_backend.config.validation import validate
        from fsdp2_backend.data.sft.pipeline import training_rows
        from fsdp2_backend.data.tokenizer import load_tokenizer

        layers = []
        if rest and rest[0].endswith((".yaml", ".yml")):
            layers.append((rest[0], load_yaml(rest[0])))
            rest = rest[1:]
        overrides, unknown = split_native_overrides(rest)
        if unknown:
            raise UsageError(f"{unknown[0]}: unknown argument — give CONFIG.yaml, --group.field value, --num N, "
                             "--json")
        if overrides:
            layers.append(("--group.field overrides", overrides))
        config = validate(build_config(layers))
        if config.data.data_manager_type != "lf":
            raise UsageError("data.data_manager_type: preview_data shows the fine-tuning data path (lf) — set "
                             "data.data_manager_type: lf")
        hf = load_tokenizer(config.model).hf
        for n, row in enumerate(training_rows(config, hf)):
            if n == num:
                break
            if as_json:
                print(json.dumps({"input_ids": row["input_ids"], "labels": row["labels"],
                                  "doc_lens": row["doc_lens"]}))
            else:
                print(f"=== {n} ===")
                print(marked_text(hf, row["input_ids"], row["labels"], row["doc_lens"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
