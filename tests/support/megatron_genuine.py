"""Test-only: the args namespaces Megatron-LM's own parser made (``tests/data/megatron_genuine_args/``, copied from
``shared/megatron/genuine_args``: ``parse_args()`` + ``validate_args()`` at Megatron-LM core_r0.16, see its
SOURCE.txt) — what every genuine Megatron-LM checkpoint pickles as ``args``, ``exit_signal: signal.Signals`` and
megatron's ``AttnBackend`` enum included.

`genuine_args(name, **run)` loads one with megatron's real classes (megatron-core is installed for the tests; the
package under test reads them through its allow-list instead) and sets only what a real run itself sets on the
namespace after parsing before it saves: ``padded_vocab_size`` (Megatron-LM's build_tokenizer) and the training
loop's counters (``consumed_train_samples``, ...). Nothing else is changed, so a reader that refuses or misreads a
field of these refuses or misreads every genuine checkpoint.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

GENUINE = Path(__file__).resolve().parents[1] / "data" / "megatron_genuine_args"
NAMES = ("llama_dense", "deepseek_mla")

# What Megatron-LM sets on args between validate_args and a checkpoint save (nothing else may be passed).
RUN_SET_FIELDS = frozenset({"padded_vocab_size", "consumed_train_samples", "consumed_valid_samples",
                            "skipped_train_samples", "iteration", "curr_iteration"})


def genuine_args(name: str, **run):
    """The genuine namespace ``name`` with the run-time fields ``run`` set (a fresh object each call)."""
    import argparse
    import signal

    from megatron.core.transformer.enums import AttnBackend

    unknown = set(run) - RUN_SET_FIELDS
    assert not unknown, f"{sorted(unknown)} are parser fields: a genuine namespace keeps the parser's values"
    with torch.serialization.safe_globals([argparse.Namespace, signal.Signals, AttnBackend]):
        args = torch.load(GENUINE / name / "args.pt", weights_only=True)["args"]
    for key, value in run.items():
        setattr(args, key, value)
    return args


def megatron_padded_vocab(args) -> int:
    """Megatron-LM's _vocab_size_with_padding of its tokenizer's vocabulary (the NullTokenizer's is --vocab-size + 1:
    it appends the eod id), rounded up to make_vocab_size_divisible_by × TP."""
    tokens = args.vocab_size + (1 if args.tokenizer_type == "NullTokenizer" else 0)
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return -(-tokens // multiple) * multiple


def listing(name: str) -> dict:
    """args.json: the command line Megatron-LM parsed, the field count and every non-builtin field's type."""
    return json.loads((GENUINE / name / "args.json").read_text())
