"""Megatron's `--tokenizer-type TikTokenizer`: a tiktoken BPE read from Megatron's JSON vocabulary.

The BPE itself is the `tiktoken` library's; this module only reads Megatron's vocabulary format and lays out
the ids as megatron-core 0.16.1 does (`megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py`,
built by `tokenizers/text/utils/build_tokenizer.py`), so that token ids, eod and vocabulary size are Megatron's:

- The vocabulary file (`--tokenizer-model`, a `.json`) is a list of `{"rank", "token_bytes" (base64),
  "token_str"}` with `rank` = position and the first 256 entries the single bytes 0..255.
- The special tokens come first: ids 0..N-1 (N = `--tiktoken-num-special-tokens`, default 1000) are
  `--tokenizer-special-tokens` (default `<unk> <s> </s> <mask> <pad> <cls> <sep>`, which a custom list must
  contain) followed by `<SPECIAL_i>` fillers; BPE rank r has id r + N.
- The vocabulary size is `--vocab-size` (default 2**17) and the file is cut to its first vocab_size - N
  entries (it must have at least that many).
- `--tiktoken-pattern` v1 / v2 picks the pre-tokenizer regex (default v2).
- tokenize = `encode(text, allowed_special="all")`: a special token's text in the input is that token.
- eod = eos = the id of `</s>`, bos = `<s>`, pad = `<pad>`.
Megatron asserts on a malformed vocabulary; here each problem is one usage error naming the flag.
"""
from __future__ import annotations

import base64
import json
import os
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

from megatron_compat.data.tokenizer_identity import _TEXT_TOKENIZER
from fsdp2_backend.usage_errors import UsageError

# the two pre-tokenizer regexes of megatron-core 0.16.1 (tiktoken_tokenizer.py), verbatim facts
PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
FILLER = "<SPECIAL_{id}>"


def read_vocabulary(path: str, count: int, offset: int) -> Dict[bytes, int]:
    """{token bytes: id} of the first `count` entries of Megatron's JSON vocabulary, ids shifted by `offset`."""
    flag = "--tokenizer-model"
    if not path.endswith(".json"):
        raise UsageError(f"{flag}: {path} is not a .json vocabulary — TikTokenizer reads Megatron's JSON list "
                         "of {rank, token_bytes, token_str}")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag}: {path} cannot be read as JSON ({exc}) — give the tiktoken vocabulary "
                         "file") from None
    if not isinstance(entries, list):
        raise UsageError(f"{flag}: {path} holds a {type(entries).__name__}, not a list — give Megatron's "
                         "tiktoken vocabulary (a JSON list)")
    if len(entries) < count:
        raise UsageError(f"{flag}: {path} has {len(entries)} tokens but --vocab-size minus "
                         f"--tiktoken-num-special-tokens needs {count} — lower --vocab-size to "
                         f"{len(entries) + offset} or give the full vocabulary")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries[:count]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise UsageError(f"{flag}: {path} entry {i} is not {{rank: {i}, token_bytes, token_str}} — give "
                             "Megatron's tiktoken vocabulary")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise UsageError(f"{flag}: {path} entry {i} is not the single byte {i} (the first 256 ranks are "
                             "the bytes) — give Megatron's tiktoken vocabulary")
        if token in ranks:
            raise UsageError(f"{flag}: {path} entry {i} repeats the token of entry {ranks[token] - offset} — "
                             "give a vocabulary with unique tokens")
        ranks[token] = i + offset
    return ranks


class TikTokenizer:
    """Megatron's TikTokenizer (see the module docstring); megatron_compat's tokenizer surface."""

    tokenizer_type = "TikTokenizer"
    hf = None

    def __init__(self, tokenizer_model: str, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: Optional[int] = None, special_tokens: Optional[Sequence[str]] = None) -> None:
        self._init_kwargs = dict(tokenizer_model=tokenizer_model, pattern=pattern, vocab_size=vocab_size,
                                 num_special_tokens=num_special_tokens, special_tokens=special_tokens)
        import tiktoken

        if not tokenizer_model:
            raise UsageError("--tokenizer-model: required by --tokenizer-type TikTokenizer — give the tiktoken "
                             "vocabulary .json")
        if not os.path.exists(tokenizer_model):
            raise UsageError(f"--tokenizer-model: {tokenizer_model} not found — check the path")
        if (pattern or "v2") not in PATTERNS:
            raise UsageError(f"--tiktoken-pattern: {pattern!r} — use v1 or v2")
        total = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        count = DEFAULT_NUM_SPECIAL_TOKENS if num_special_tokens is None else int(num_special_tokens)
        specials = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL_TOKENS)
        if len(set(specials)) != len(specials):
            raise UsageError(f"--tokenizer-special-tokens: {' '.join(specials)} repeats a token — list each once")
        missing = [t for t in REQUIRED_SPECIAL_TOKENS if t not in specials]
        if missing:
            raise UsageError(f"--tokenizer-special-tokens: misses {' '.join(missing)} — TikTokenizer needs "
                             f"{' '.join(REQUIRED_SPECIAL_TOKENS)} among its special tokens")
        if not len(specials) <= count < total:
            raise UsageError(f"--tiktoken-num-special-tokens: {count} must be at least the {len(specials)} special "
                             f"tokens and below --vocab-size {total} — adjust one of them")
        self.special_tokens = specials + [FILLER.format(id=i) for i in range(len(specials), count)]
        if len(set(self.special_tokens)) != count:
            raise UsageError("--tokenizer-special-tokens: a token collides with a <SPECIAL_i> filler name — "
                             "rename it")
        self.num_special_tokens = count
        ranks = read_vocabulary(tokenizer_model, total - count, count)
        self.encoding = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(tokenizer_model))),
                                          pat_str=PATTERNS[pattern or "v2"], mergeable_ranks=ranks,
                                          special_tokens={t: i for i, t in enumerate(self.special_tokens)})
        self.vocab_size = total
        self.eod = self.special_tokens.index("</s>")
        self.bos = self.special_tokens.index("<s>")
        self.pad = self.special_tokens.index("<pad>")
        self.unique_identifiers = self._identifiers(tokenizer_model, pattern, vocab_size, count, special_tokens)

    @staticmethod
    def _identifiers(path, pattern, vocab_size, count, special_tokens) -> "OrderedDict[str, Optional[str]]":
        """megatron-core's cache description: its class, the path, then build_tokenizer's keyword arguments in
        its order (pattern and vocab_size only when given)."""
        ids: "OrderedDict[str, Optional[str]]" = OrderedDict()
        ids["class"] = _TEXT_TOKENIZER
        ids["tokenizer_path"] = path
        if pattern:
            ids["pattern"] = str(pattern)
        if vocab_size:
            ids["vocab_size"] = str(vocab_size)
        ids["num_special_tokens"] = str(count)
        ids["special_tokens"] = str(list(special_tokens) if special_tokens else None)
        return ids

    def __reduce__(self):  # workers rebuild the tokenizer from its arguments
        return _construct, (self._init_kwargs,)

    def tokenize(self, text: str) -> List[int]:
        return self.encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self.encoding.encode_batch(list(texts), num_threads=1, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        """Megatron's `ids_to_text`: each token's text joined (a token's bytes decoded on their own, invalid
        UTF-8 replaced), special tokens by name."""
        return "".join(self.special_tokens[i] if i < self.num_special_tokens
                       else self.encoding.decode_single_token_bytes(i).decode("utf-8", errors="replace")
                       for i in ids)


def _construct(init_kwargs: dict) -> TikTokenizer:
    return TikTokenizer(**init_kwargs)
