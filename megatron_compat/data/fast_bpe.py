"""A fast path for Hugging Face byte-level BPE tokenizers (GPT-2, Qwen, Llama 3, GPT-OSS style): tiktoken.

tiktoken, given the same byte-level vocabulary, the merges as ranks, the same pre-tokenizer pattern and the
added tokens as its special tokens, produces the same ids as the `tokenizers` library several times faster
(its BPE is a rank-ordered merge loop over each regex piece; HF's is the same algorithm with more
bookkeeping for offsets). `TiktokenBPE.from_hf` reads the HF tokenizer's JSON and raises `NotRepresentable`
for anything tiktoken cannot reproduce: normalizers other than NFC, pre-tokenizers other than ByteLevel or
Split+ByteLevel, lstrip/rstrip/single-word added tokens, non-byte-level vocabularies, merges whose result ids
are not in merge order, post-processors other than a template (e.g. a BOS) or ByteLevel.

`select_fast_path(tokenizer, sample)` builds it and checks it against the HF tokenizer on a sample of the
real input (plus probes around every added token); it returns None and the reason when it cannot be used,
so callers fall back to the HF tokenizer. `tokenizer` is megatron_compat's HF wrapper or a transformers
tokenizer itself; the `tokenizers.Tokenizer` is found by `rust_tokenizer` (on transformers 5 a transformers
tokenizer's `.backend` is the *name* of its backend, "tokenizers" or "sentencepiece", not the object).
"""
from __future__ import annotations

import json
import re
import unicodedata
from typing import List, Optional, Sequence, Tuple

# The pattern of tokenizers' ByteLevel pre-tokenizer with use_regex=True (GPT-2's).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class NotRepresentable(Exception):
    """The HF tokenizer uses something the tiktoken path does not reproduce."""


def _byte_level_alphabet() -> dict:
    """GPT-2's reversible map from the 256 bytes to printable characters, as {character: byte}."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    char_of_byte = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of_byte:
            char_of_byte[b] = chr(256 + extra)
            extra += 1
    return {char: b for b, char in char_of_byte.items()}


def _pattern(pre_tokenizer: Optional[dict]) -> str:
    """The one regex that splits text as the HF pre-tokenizer does."""
    def byte_level(node, regex_allowed):
        if node.get("type") != "ByteLevel" or node.get("add_prefix_space"):
            raise NotRepresentable(f"pre-tokenizer {node.get('type')} (add_prefix_space="
                                   f"{node.get('add_prefix_space')})")
        if node.get("use_regex", True) and not regex_allowed:
            raise NotRepresentable("a Split pre-tokenizer followed by a regex ByteLevel")
        return node.get("use_regex", True)

    if pre_tokenizer is None:
        raise NotRepresentable("no pre-tokenizer (not byte-level)")
    if pre_tokenizer.get("type") == "ByteLevel":
        byte_level(pre_tokenizer, True)
        return GPT2_PATTERN
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" else []
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        byte_level(steps[0], True)
        return GPT2_PATTERN
    if len(steps) != 2 or steps[0].get("type") != "Split":
        raise NotRepresentable(f"pre-tokenizer {json.dumps(pre_tokenizer)[:120]}")
    split = steps[0]
    if split.get("behavior") != "Isolated" or split.get("invert"):
        raise NotRepresentable(f"Split pre-tokenizer behaviour {split.get('behavior')}, invert "
                               f"{split.get('invert')}")
    byte_level(steps[1], False)
    pattern = split["pattern"]
    return pattern["Regex"] if "Regex" in pattern else re.escape(pattern["String"])


def _normalize_function(normalizer: Optional[dict]):
    if normalizer is None or (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
        return None
    if normalizer.get("type") == "NFC":
        return lambda text: unicodedata.normalize("NFC", text)
    raise NotRepresentable(f"normalizer {normalizer.get('type')}")


def _template(post_processor: Optional[dict]) -> Tuple[List[int], List[int]]:
    """(ids before, ids after) the text that the post-processor adds to a single sequence."""
    if post_processor is None:
        return [], []
    kind = post_processor.get("type")
    if kind == "ByteLevel":  # only trims offsets
        return [], []
    if kind == "Sequence":
        before, after = [], []
        for step in post_processor["processors"]:
            b, a = _template(step)
            before, after = before + b, after + a
        return before, after
    if kind != "TemplateProcessing":
        raise NotRepresentable(f"post-processor {kind}")
    before, after, seen_text = [], [], False
    for piece in post_processor["single"]:
        if "Sequence" in piece:
            seen_text = True
        else:
            ids = post_processor["special_tokens"][piece["SpecialToken"]["id"]]["ids"]
            (after if seen_text else before).extend(ids)
    return before, after


class TiktokenBPE:
    """A byte-level BPE tokenizer run by tiktoken; `tokenize_batch` gives the HF tokenizer's ids."""

    def __init__(self, encoding, normalize, before: List[int], after: List[int]) -> None:
        self._encoding = encoding
        self._normalize = normalize
        self._before, self._after = before, after
        self._special = frozenset(encoding.special_tokens_set)

    @classmethod
    def from_hf(cls, tokenizer_json: str, add_special_tokens: bool = True) -> "TiktokenBPE":
        """Builds it from `tokenizers.Tokenizer.to_str()`; NotRepresentable when it cannot.

        `add_special_tokens=False` leaves out what the post-processor adds (as `encode(..., False)`)."""
        import tiktoken

        spec = json.loads(tokenizer_json)
        model = spec["model"]
        if model.get("type") != "BPE":
            raise NotRepresentable(f"model {model.get('type')}")
        if model.get("dropout") or model.get("byte_fallback") or model.get("continuing_subword_prefix") \
                or model.get("end_of_word_suffix"):
            raise NotRepresentable("BPE dropout/byte_fallback/subword prefix or suffix")
        pattern = _pattern(spec.get("pre_tokenizer"))
        normalize = _normalize_function(spec.get("normalizer"))
        before, after = _template(spec.get("post_processor")) if add_special_tokens else ([], [])

        special = {}
        for token in spec.get("added_tokens", []):
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                raise NotRepresentable(f"added token {token['content']!r} with lstrip/rstrip/single_word")
            if token.get("normalized") and normalize is not None:
                raise NotRepresentable(f"added token {token['content']!r} matched after normalisation")
            special[token["content"]] = token["id"]
        contents = sorted(special)
        # tiktoken matches special tokens leftmost-first, HF leftmost-longest: only the same without prefixes
        for shorter, longer in zip(contents, contents[1:]):
            if longer.startswith(shorter):
                raise NotRepresentable(f"added token {shorter!r} is a prefix of {longer!r}")

        alphabet = _byte_level_alphabet()
        vocab = model["vocab"]

        def to_bytes(token: str) -> bytes:
            try:
                return bytes(alphabet[c] for c in token)
            except KeyError:
                raise NotRepresentable(f"vocabulary token {token!r} is not byte-level") from None

        ranks = {}
        for token, byte in alphabet.items():
            if token not in vocab:
                raise NotRepresentable(f"byte {byte} has no token (not a full byte-level alphabet)")
            ranks[bytes([byte])] = vocab[token]
        # tiktoken merges the pair whose result has the lowest rank; HF the pair listed first. Using the HF
        # ids as ranks is therefore exact when merge results carry increasing ids, as trained BPEs do.
        last_id = -1
        for merge in model["merges"]:
            left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
            merged = to_bytes(left + right)
            if merged in ranks:
                continue
            token_id = vocab.get(left + right)
            if token_id is None or token_id <= last_id:
                raise NotRepresentable(f"merge {left!r} {right!r} does not yield increasing token ids")
            ranks[merged] = last_id = token_id
        if model.get("ignore_merges"):  # HF then takes a whole piece found in the vocabulary as is
            for token, token_id in vocab.items():
                if token not in special:
                    ranks.setdefault(to_bytes(token), token_id)
        for content in special:
            ranks.pop(content.encode("utf-8"), None)
        encoding = tiktoken.Encoding("hf-byte-level-bpe", pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens=special)
        return cls(encoding, normalize, before, after)

    @property
    def added_tokens(self) -> List[str]:
        """Texts matched whole before BPE (HF's added tokens)."""
        return sorted(self._special)

    def tokenize(self, text: str) -> List[int]:
        if self._normalize is not None:
            text = self._normalize(text)
        ids = self._encoding.encode(text, allowed_special=self._special, disallowed_special=())
        if self._before or self._after:
            ids = self._before + ids + self._after
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]


def _probes(added_tokens: Sequence[str]) -> List[str]:
    """Texts around the edges the fast path must get right: whitespace runs, digits, added tokens."""
    probes = ["", " ", "\n\n", "  x  \n\t y", "I'm 12345 ok!!  ", "héllo wörld ✓ 日本語 🙂", "a\r\nb\u00a0c"]
    for token in added_tokens:
        probes += [token, f"a{token}b", f" {token} \n", f"{token}{token}x"]
    return probes


def rust_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` (megatron_compat's HF wrapper, or a transformers fast
    tokenizer), or None (a slow / SentencePiece tokenizer). Only an object with `to_str` counts: on
    transformers 5 `PreTrainedTokenizerBase.backend` is a string naming the backend."""
    for owner in (tokenizer, getattr(tokenizer, "hf", None)):
        for name in ("backend_tokenizer", "_tokenizer", "backend"):
            candidate = getattr(owner, name, None) if owner is not None else None
            if callable(getattr(candidate, "to_str", None)):
                return candidate
    return None


def _reference_ids(tokenizer, texts: Sequence[str]) -> List[List[int]]:
    """The ids the slow path gives: megatron_compat's `tokenize_batch`, else the transformers call itself."""
    if hasattr(tokenizer, "tokenize_batch"):
        return tokenizer.tokenize_batch(texts)
    return [list(ids) for ids in tokenizer(list(texts))["input_ids"]] if texts else []


def first_disagreement(fast, tokenizer, texts: Sequence[str]) -> Optional[int]:
    """The index of the first text a fast path tokenizes differently from the reference tokenizer, or None."""
    expected = _reference_ids(tokenizer, texts)
    for n, (text, ids) in enumerate(zip(texts, expected)):
        if fast.tokenize(text) != ids:
            return n
    return None


def select_fast_path(tokenizer, sample: Sequence[str]) -> Tuple[Optional[TiktokenBPE], str]:
    """(fast tokenizer or None, what was decided and why), checked against `tokenizer` on `sample`."""
    backend = rust_tokenizer(tokenizer)
    if backend is None:
        kind = getattr(tokenizer, "tokenizer_type", None) or type(tokenizer).__name__
        return None, f"{kind} has no byte-level BPE fast path (no `tokenizers` backend)"
    try:
        fast = TiktokenBPE.from_hf(backend.to_str(), getattr(tokenizer, "include_special_tokens", True))
    except NotRepresentable as exc:
        return None, f"the tiktoken fast path cannot represent this tokenizer ({exc})"
    texts = list(sample) + _probes(fast.added_tokens)
    mismatch = first_disagreement(fast, tokenizer, texts)
    if mismatch is not None:
        return None, (f"the tiktoken fast path disagrees with the HF tokenizer on sample text {mismatch} "
                      f"({texts[mismatch][:40]!r})")
    return fast, f"tiktoken fast path, identical to the HF tokenizer on {len(texts)} sample texts"
