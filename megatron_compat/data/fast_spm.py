"""A fast path for SentencePiece BPE models (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer).

`SentencePieceProcessor.encode` spends most of its time in its BPE merge loop. The same ids come out of:
SentencePiece's own normalizer (`normalize`: the model's character map, whitespace rules, dummy prefix, `▁`
escaping), then tiktoken's BPE over the normalized text, given the pieces as UTF-8 byte strings ranked by
descending score. Why that is exact:
- SentencePiece BPE starts from characters, tiktoken from bytes: every multi-byte character that is a piece
  (and every prefix of its UTF-8 bytes) gets a rank below all real merges, so characters form first;
- it merges the adjacent pair with the best score (the leftmost on ties), tiktoken the pair with the lowest
  rank (leftmost on ties): ranks in score order give the same merges;
- no piece contains `▁` after its first character (required, else NotRepresentable), so splitting the text
  before each `▁` changes nothing;
- characters that are not pieces can join no merge: runs of them are cut out and emitted as SentencePiece
  does (one unknown id per run, or their UTF-8 bytes' pieces for byte-fallback models).
Models with user-defined pieces (matched whole by SentencePiece) or unused pieces, and non-BPE models
(Unigram), raise NotRepresentable.

`select_fast_path(tokenizer, sample)` builds it and checks it against the tokenizer's own ids on a sample of
the real input plus probes; it returns None and the reason when it cannot be used, so callers fall back.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_compat.data.fast_bpe import NotRepresentable, first_disagreement

_NORMAL, _USER_DEFINED, _UNUSED = 1, 4, 5  # SentencePiece's piece types (sentencepiece_model.proto)
_BPE = 2  # TrainerSpec.model_type
_SPACE = "\u2581"


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    """(field number, wire type, value) of a protobuf message; length-delimited values as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise NotRepresentable(f"model file: protobuf wire type {wire}")
        yield number, wire, value


def _model_facts(model_proto: bytes) -> Tuple[int, List[int]]:
    """(model type, piece types) read from the serialized ModelProto (no protobuf dependency)."""
    types, model_type = [], 1  # proto defaults: NORMAL piece, UNIGRAM model
    for number, _, value in _fields(model_proto):
        if number == 1:  # ModelProto.pieces
            types.append(next((v for n, _, v in _fields(value) if n == 3), _NORMAL))
        elif number == 2:  # ModelProto.trainer_spec
            model_type = next((v for n, _, v in _fields(value) if n == 3), model_type)
    return model_type, types


class TiktokenSentencePiece:
    """A SentencePiece BPE model run as normalize + tiktoken; `tokenize_batch` gives `sp.encode`'s ids."""

    def __init__(self, processor, encoding, id_of_rank: List[int], unknown: "re.Pattern",
                 byte_ids: Optional[Dict[int, int]]) -> None:
        self._sp = processor
        self._encoding = encoding
        self._id_of_rank = id_of_rank
        self._unknown = unknown
        self._byte_ids = byte_ids  # byte -> id of its <0xXX> piece, for byte-fallback models
        self._unk = processor.unk_id()

    @classmethod
    def from_processor(cls, processor) -> "TiktokenSentencePiece":
        """Builds it from a loaded `SentencePieceProcessor`; NotRepresentable when it cannot."""
        import tiktoken

        if not hasattr(processor, "normalize"):  # sentencepiece < 0.1.99 does not expose its normalizer
            raise NotRepresentable("this sentencepiece version has no normalize()")
        model_type, types = _model_facts(processor.serialized_model_proto())
        if model_type != _BPE:
            raise NotRepresentable(f"SentencePiece model type {model_type} (only BPE, type 2)")
        if len(types) != processor.get_piece_size():
            raise NotRepresentable("model file pieces do not match the loaded model")
        for kind, name in ((_USER_DEFINED, "user-defined"), (_UNUSED, "unused")):
            if kind in types:
                raise NotRepresentable(f"{name} piece {processor.id_to_piece(types.index(kind))!r}")
        normal = {processor.id_to_piece(i): i for i, kind in enumerate(types) if kind == _NORMAL}
        chars = {piece for piece in normal if len(piece) == 1}
        for piece in normal:
            if _SPACE in piece[1:]:
                raise NotRepresentable(f"piece {piece!r} has {_SPACE!r} inside (not split by whitespace)")
            if not set(piece) <= chars:
                raise NotRepresentable(f"piece {piece!r} has a character that is not a piece")
        # ranks: the 256 bytes, then partial and whole multi-byte characters, then the merges by score
        ranks, id_of_rank = {}, []

        def add(data: bytes, token_id: int) -> None:
            if data not in ranks:
                ranks[data] = len(id_of_rank)
                id_of_rank.append(token_id)

        for byte in range(256):
            add(bytes([byte]), normal.get(chr(byte), processor.unk_id()) if byte < 128 else processor.unk_id())
        for char in sorted(chars):
            data = char.encode("utf-8")
            for end in range(2, len(data)):
                add(data[:end], processor.unk_id())  # never output: only whole characters are segments
            add(data, normal[char])
        merged = sorted((piece for piece in normal if len(piece) > 1),
                        key=lambda piece: (-processor.get_score(normal[piece]), normal[piece]))
        scores = [processor.get_score(normal[piece]) for piece in merged]
        if len(set(scores)) != len(scores):
            raise NotRepresentable("pieces with equal scores (merge order ambiguous)")
        for piece in merged:
            add(piece.encode("utf-8"), normal[piece])
        encoding = tiktoken.Encoding("sentencepiece-bpe", pat_str=f"{_SPACE}[^{_SPACE}]*|[^{_SPACE}]+",
                                     mergeable_ranks=ranks, special_tokens={})
        byte_ids = {b: processor.piece_to_id(f"<0x{b:02X}>") for b in range(256)}
        if not all(processor.is_byte(i) for i in byte_ids.values()):
            byte_ids = None
        unknown = re.compile("[^" + "".join(re.escape(c) for c in sorted(chars)) + "]+")
        return cls(processor, encoding, id_of_rank, unknown, byte_ids)

    def _known(self, text: str) -> List[int]:
        id_of_rank = self._id_of_rank
        return [id_of_rank[r] for r in self._encoding.encode_ordinary(text)]

    def tokenize(self, text: str) -> List[int]:
        text = self._sp.normalize(text)
        if self._unknown.search(text) is None:
            return self._known(text)
        ids, start = [], 0
        for run in self._unknown.finditer(text):
            ids += self._known(text[start:run.start()])
            if self._byte_ids is None:
                ids.append(self._unk)
            else:
                ids += [self._byte_ids[b] for b in run.group().encode("utf-8")]
            start = run.end()
        return ids + self._known(text[start:])

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(text) for text in texts]


_PROBES = ["", " ", "   ", "\n\n", "  x  \n\t y  ", "a  b", "I'm 12345 ok!!  ", "héllo wörld ✓ 日本語 🙂",
           "a\r\nb\u00a0c\u3000d", "ｶﾀｶﾅ ﬁ ①", "\x00\x01x\x7f", "☃☃ ☃x☃", "\U0001f600\U0001f600a", "▁▁a ▁"]


def select_fast_path(tokenizer, sample: Sequence[str]) -> Tuple[Optional[TiktokenSentencePiece], str]:
    """(fast tokenizer or None, what was decided and why), checked against `tokenizer` on `sample`."""
    processor = getattr(tokenizer, "sp", None)
    if processor is None:
        return None, f"{tokenizer.tokenizer_type} has no SentencePiece fast path"
    try:
        fast = TiktokenSentencePiece.from_processor(processor)
    except NotRepresentable as exc:
        return None, f"the SentencePiece fast path cannot represent this model ({exc})"
    texts = list(sample) + _PROBES
    mismatch = first_disagreement(fast, tokenizer, texts)
    if mismatch is not None:
        return None, (f"the SentencePiece fast path disagrees with SentencePiece on sample text {mismatch} "
                      f"({texts[mismatch][:40]!r})")
    return fast, f"SentencePiece fast path (tiktoken BPE), identical to SentencePiece on {len(texts)} sample texts"
