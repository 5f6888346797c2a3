"""The tokenizer a Megatron-LM checkpoint carries: the model-argument fields naming it, for a ``--load`` run given no
tokenizer flag.

Layout facts (Megatron-LM ``megatron/training/checkpointing.py`` ``save_tokenizer_assets``, on by default —
``--no-save-tokenizer-assets`` turns it off — for ``--ckpt-format torch_dist`` saves after iteration 0): rank 0
writes ``iter_*/tokenizer/`` by the saved ``--tokenizer-type`` (args ``tokenizer_type``):

- ``HuggingFaceTokenizer`` (and ``MultimodalTokenizer``): the tokenizer's ``save_pretrained`` files;
- ``GPT2BPETokenizer``: ``vocab.json`` and ``merges.txt``; ``BertWordPiece*``: ``vocab.txt``;
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``: ``tokenizer.model``;
- ``TikTokenizer``: ``tokenizer.json`` (its pattern, special tokens and vocabulary size stay in the args);
- ``NullTokenizer``: nothing — the args' ``vocab_size`` is the tokenizer.

The other tokenizer settings are read from the saved args under their argparse dests (``--tokenizer-special-tokens``
is ``special_tokens``, ``--tokenizer-hf-no-use-fast`` is ``tokenizer_hf_no_use_fast``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

TOKENIZER_DIR = "tokenizer"
_SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def checkpoint_tokenizer(it_dir: Path, args: Any) -> Optional[dict]:
    """{model field: value} for the tokenizer ``it_dir`` carries (None when it carries none this run can use)."""
    kind = getattr(args, "tokenizer_type", None)
    folder = Path(it_dir) / TOKENIZER_DIR
    files = {"HuggingFaceTokenizer": {"tokenizer_model": folder},
             "GPT2BPETokenizer": {"vocab_file": folder / "vocab.json", "merge_file": folder / "merges.txt"},
             "TikTokenizer": {"tokenizer_model": folder / "tokenizer.json"},
             **{k: {"tokenizer_model": folder / "tokenizer.model"} for k in _SENTENCEPIECE}}
    if kind == "NullTokenizer" and getattr(args, "vocab_size", None):
        return {"tokenizer_type": kind, "vocab_size": int(args.vocab_size)}
    if kind not in files or not all(p.exists() for p in files[kind].values()):
        return None
    fields: dict = {"tokenizer_type": kind, **{k: str(p) for k, p in files[kind].items()}}
    if kind == "HuggingFaceTokenizer":
        fields["use_fast_tokenizer"] = not getattr(args, "tokenizer_hf_no_use_fast", False)
    if kind == "TikTokenizer":
        fields.update({k: v for k, v in (("tiktoken_pattern", getattr(args, "tiktoken_pattern", None)),
                                         ("tiktoken_num_special_tokens", getattr(args, "tiktoken_num_special_tokens",
                                                                                 None)),
                                         ("tokenizer_special_tokens", getattr(args, "special_tokens", None)),
                                         ("vocab_size", getattr(args, "vocab_size", None))) if v is not None})
    return fields


__all__ = ["TOKENIZER_DIR", "checkpoint_tokenizer"]
