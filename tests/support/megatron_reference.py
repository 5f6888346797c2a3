"""Test-only helpers for parity with megatron-core 0.16.1 (the reference implementation; never imported by
package code): tiny corpora written by megatron-core's own IndexedDatasetBuilder, a minimal tokenizer object
carrying the ids the datasets read, and a sample-by-sample comparison.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import numpy
import torch

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*pad token id.*")

EOD = 0


class IdsTokenizer:
    """The attributes GPT datasets read from a tokenizer: eod, vocab_size, optionally pad; and the
    `unique_identifiers` megatron-core puts in its cache description."""

    def __init__(self, vocab_size: int = 1000, eod: int = EOD, pad: Optional[int] = None):
        self.vocab_size = vocab_size
        self.eod = eod
        if pad is not None:
            self.pad = pad
        self.unique_identifiers = {"class": "IdsTokenizer", "vocab_size": vocab_size, "eod": eod, "pad": pad}


def write_corpus(prefix: str, num_docs: int, seed: int, max_len: int = 80, vocab_size: int = 1000,
                 empty_every: int = 0) -> str:
    """Random documents ending in EOD, written by megatron-core's builder; every `empty_every`-th one empty."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    rng = numpy.random.default_rng(seed)
    dtype = numpy.uint16 if vocab_size < 65500 else numpy.int32
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for i in range(num_docs):
        if empty_every and i % empty_every == empty_every - 1:
            tokens = numpy.zeros(0, dtype=numpy.int64)
        else:
            tokens = rng.integers(1, vocab_size, int(rng.integers(1, max_len)))
            tokens[-1] = EOD
            tokens[rng.random(len(tokens)) < 0.03] = EOD  # EODs inside documents too
        builder.add_item(torch.from_numpy(tokens))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def assert_same_samples(reference, ours, indices=None) -> None:
    """Equal length and, for every (or the given) index, the same keys, dtypes and values."""
    assert len(reference) == len(ours)
    for i in range(len(reference)) if indices is None else indices:
        expected, got = reference[i], ours[i]
        assert sorted(expected) == sorted(got), (i, sorted(expected), sorted(got))
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == got[key].dtype, (i, key, value.dtype, got[key].dtype)
                assert torch.equal(value, got[key]), (i, key)
            else:
                assert int(value) == int(got[key]), (i, key)


def megatron_lm_args(*argv: str, **derived):
    """The args namespace Megatron-LM saves in its checkpoints for the flags ``argv``: every dest with its default
    (``megatron_lm_arguments.json``, Megatron-LM's own parser dump, shipped verbatim in megatron_compat/parse/), the flags parsed by an
    argparse built from it — so a test's saved args carry Megatron's dest names (``--norm-epsilon`` is
    ``layernorm_epsilon``), not the reader's guesses. ``derived``: what Megatron-LM's validate_args / tokenizer
    build then set (``padded_vocab_size``, ...)."""
    import argparse
    import ast
    import json

    from megatron_compat.parse.arguments import MEGATRON_TABLE  # the verbatim copy the package ships

    with open(MEGATRON_TABLE) as f:
        table = json.load(f)

    def moe_freq(text):  # Megatron-LM's moe_freq_type: an int, or a list ("[1,0,1]")
        return int(text) if text.strip().isdigit() else list(ast.literal_eval(text))

    types = {"int": int, "float": float, "str": str, "moe_freq_type": moe_freq,
             "bool": lambda text: text.lower() in ("1", "true", "yes")}
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for entry in table:
        action = entry["action"]
        if action == "_HelpAction":
            continue
        kwargs = {"dest": entry["dest"], "default": argparse.SUPPRESS}  # defaults set below, not type-converted
        if action == "_StoreTrueAction":
            kwargs["action"] = "store_true"
        elif action == "_StoreFalseAction":
            kwargs["action"] = "store_false"
        elif action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
            entry = {**entry, "flags": [f for f in entry["flags"] if not f.startswith("--no-")]}
        else:
            kwargs.update(type=types.get(entry["type"], str), nargs=entry["nargs"], choices=entry["choices"])
        parser.add_argument(*entry["flags"], **kwargs)
    args = parser.parse_args(list(argv))
    for entry in table:
        if entry["action"] != "_HelpAction" and not hasattr(args, entry["dest"]):
            setattr(args, entry["dest"], entry["default"])
    _as_megatron_types(args, table)
    for name, value in derived.items():
        setattr(args, name, value)
    return args


def _as_megatron_types(args, table) -> None:
    """What the JSON dump loses and Megatron-LM's parser keeps (the genuine namespaces in
    tests/data/megatron_genuine_args show it): enum fields hold their enums (``exit_signal`` a ``signal.Signals``,
    ``attention_backend`` megatron's ``AttnBackend``), and validate_args turns the dtype choices into torch dtypes
    (``params_dtype`` from --bf16 / --fp16, the optimizer's ``main_*`` / ``exp_avg*`` dtypes)."""
    import signal

    from megatron.core.transformer.enums import AttnBackend

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
    for entry in table:
        value = getattr(args, entry["dest"], None)
        if entry["type"] != "enum_type_handler" or value is None:
            continue
        if entry["dest"] == "exit_signal":
            args.exit_signal = signal.Signals(int(value))
        elif entry["dest"] == "attention_backend":
            name = str(value).strip("<>").split(":")[0].rpartition(".")[2]
            args.attention_backend = AttnBackend[name]
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    for dest in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        if isinstance(getattr(args, dest, None), str):
            setattr(args, dest, dtypes[getattr(args, dest)])
