"""Megatron's MMIDIDX v1 indexed dataset: the `.idx`/`.bin` pair every Megatron pretraining job reads.

Written here (not imported from megatron-core) because megatron-core pulls in torch, Transformer Engine
probes and object-storage clients just to read a flat file; the format is small and fully specified:

    .idx  = b"MMIDIDX\\x00\\x00" | <Q version=1 | <B dtype code | <Q sequence count N | <Q document count D
            | int32[N] sequence lengths | int64[N] byte pointers into .bin | int64[D] document indices
            | int8[N] sequence modes (multimodal only)
    .bin  = the tokens of every sequence, back to back, in the dtype named by the code

`document_indices` starts at 0 and holds, for each document, the index one past its last sequence, so a
file with D-1 documents has D entries. Names and signatures follow megatron-core 0.16.1
(`IndexedDataset`, `IndexedDatasetBuilder`, `DType`, `get_idx_path`, `get_bin_path`) so that switching
an import is all a user changes; files written here are byte-identical to megatron-core's.

Every problem found when opening a pair (missing file, wrong magic, unknown version or dtype code,
truncated index, `.bin` shorter or longer than the index says, byte pointers that disagree with the dtype
code) raises `UsageError` naming the file. `max_token_id` (the largest id in the `.bin`, cached beside the
index) lets the caller check the data against its vocabulary.
"""
from __future__ import annotations

import logging
import os
import shutil
import struct
from array import array
from enum import Enum
from typing import Optional, Sequence, Tuple, Type, Union

import numpy

from fsdp2_backend.usage_errors import UsageError

logger = logging.getLogger(__name__)

_INDEX_MAGIC = b"MMIDIDX\x00\x00"
_INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document count
_HEADER = struct.Struct("<9sQBQQ")


class DType(Enum):
    """Token dtype codes stored in the `.idx` header (megatron's numbering)."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value) -> int:
        """The header code of a numpy dtype (class or instance)."""
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        """The numpy scalar type of a header code; ValueError for an unknown code."""
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        """Bytes per element of a header code or numpy dtype."""
        if isinstance(key, int):
            return numpy.dtype(DType.dtype_from_code(key)).itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """Megatron's rule for the token dtype: uint16 below a vocabulary of 65500, else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """The index file of a prefix."""
    return os.fspath(path_prefix) + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """The data file of a prefix."""
    return os.fspath(path_prefix) + ".bin"


def _scalar_type(dtype) -> Type[numpy.number]:
    """numpy.uint16 from numpy.uint16, numpy.dtype('uint16') or 'uint16'; UsageError for other dtypes."""
    scalar = numpy.dtype(dtype).type
    if scalar.__name__ not in DType.__members__:
        raise UsageError(f"dtype {numpy.dtype(dtype).name}: not an indexed-dataset token dtype — use one of "
                         f"{', '.join(DType.__members__)}")
    return scalar


class _IndexReader:
    """The parsed `.idx` file: header fields and zero-copy views of its arrays."""

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        self.idx_path = idx_path
        if not os.path.isfile(idx_path):
            raise UsageError(f"{idx_path}: index file not found — check the data path prefix")
        file_size = os.path.getsize(idx_path)
        if file_size < _HEADER.size:
            raise UsageError(f"{idx_path}: truncated index ({file_size} bytes, the header alone is "
                             f"{_HEADER.size}) — re-run preprocessing")
        with open(idx_path, "rb") as stream:
            magic, version, code, self.sequence_count, self.document_count = _HEADER.unpack(
                stream.read(_HEADER.size))
        if magic != _INDEX_MAGIC:
            raise UsageError(f"{idx_path}: not an MMIDIDX index (magic {magic!r}) — pass the prefix of a "
                             "file written by Megatron's preprocess_data.py")
        if version != _INDEX_VERSION:
            raise UsageError(f"{idx_path}: unsupported index version {version} (only version 1 exists) — "
                             "re-run preprocessing")
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise UsageError(f"{idx_path}: unknown token dtype code {code} (valid: 1-8) — the index is "
                             "corrupt; re-run preprocessing") from None
        self.dtype_size = DType.size(self.dtype)
        n, d = self.sequence_count, self.document_count
        expected = _HEADER.size + 4 * n + 8 * n + 8 * d + (n if multimodal else 0)
        if file_size < expected:
            raise UsageError(f"{idx_path}: truncated index ({file_size} bytes, its header announces "
                             f"{n} sequences and {d} document indices{' with modes' if multimodal else ''}"
                             f", {expected} bytes) — re-run preprocessing")
        self._mmap = numpy.memmap(idx_path, mode="r", order="C")
        buffer = memoryview(self._mmap)
        offset = _HEADER.size
        self.sequence_lengths = numpy.frombuffer(buffer, dtype=numpy.int32, count=n, offset=offset)
        offset += 4 * n
        self.sequence_pointers = numpy.frombuffer(buffer, dtype=numpy.int64, count=n, offset=offset)
        offset += 8 * n
        self.document_indices = numpy.frombuffer(buffer, dtype=numpy.int64, count=d, offset=offset)
        offset += 8 * d
        self.sequence_modes = (numpy.frombuffer(buffer, dtype=numpy.int8, count=n, offset=offset)
                               if multimodal else None)
        if d == 0 or self.document_indices[-1] != n:
            last = self.document_indices[-1] if d else "none"
            raise UsageError(f"{idx_path}: inconsistent index (last document index {last}, "
                             f"{n} sequences) — re-run preprocessing")

    def __len__(self) -> int:
        return self.sequence_count

    def __getitem__(self, idx: int) -> Tuple[numpy.int64, numpy.int32, Optional[numpy.int8]]:
        """(byte pointer, length, mode or None) of sequence `idx`."""
        mode = self.sequence_modes[idx] if self.sequence_modes is not None else None
        return self.sequence_pointers[idx], self.sequence_lengths[idx], mode

    def check_pointers(self) -> None:
        """The byte pointers must advance by length x the header's token size (megatron-core writes them so):
        catches a dtype code that disagrees with the data (e.g. uint8 in the header of uint16 tokens)."""
        n = self.sequence_count
        if n < 2:
            return
        tokens_before_last = int(self.sequence_lengths[:-1].sum(dtype=numpy.int64))
        pointer = int(self.sequence_pointers[-1]) - int(self.sequence_pointers[0])
        if pointer != tokens_before_last * self.dtype_size:
            implied = f"{pointer / tokens_before_last:g}" if tokens_before_last else "?"
            raise UsageError(f"{self.idx_path}: token dtype {numpy.dtype(self.dtype).name} ({self.dtype_size} "
                             f"bytes a token) disagrees with its sequence pointers ({implied} bytes a token) — "
                             "the dtype code is wrong or the index is corrupt; re-run preprocessing")

    def bin_bytes_needed(self) -> int:
        """The `.bin` size this index implies: the end of its last sequence."""
        if self.sequence_count == 0:
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype_size


class _MMapBinReader:
    """Reads tokens from a memory-mapped `.bin`."""

    def __init__(self, bin_path: str) -> None:
        # numpy cannot map an empty file; a dataset of only empty documents has one
        self._buffer = (numpy.memmap(bin_path, mode="r", order="C") if os.path.getsize(bin_path)
                        else numpy.empty(0, dtype=numpy.uint8))

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        return numpy.frombuffer(self._buffer, dtype=dtype, count=count, offset=offset)


class _FileBinReader:
    """Reads tokens from `.bin` with a seek and a read per call (for file systems where mmap is poor)."""

    def __init__(self, bin_path: str) -> None:
        self._bin_path = bin_path

    def read(self, dtype, count: int, offset: int) -> numpy.ndarray:
        out = numpy.empty(count, dtype=dtype)
        with open(self._bin_path, "rb", buffering=0) as stream:
            stream.seek(offset)
            got = stream.readinto(out)
        if got != out.nbytes:
            raise UsageError(f"{self._bin_path}: short read at byte {offset} — the file changed or is "
                             "truncated; re-run preprocessing")
        return out


class IndexedDataset:
    """Random access to the sequences of a `.bin/.idx` pair (megatron-core's low-level dataset).

    `dataset[i]` is sequence i's tokens (with its mode when multimodal); `dataset[a:b]` a list of them;
    `get(i, offset, length)` a window of one sequence.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True,
                 object_storage_config=None, s3_config=None, fast_cache_load: bool = False,
                 sequences_per_dataset: Optional[Tuple[int, int]] = None, dtype_code: Optional[int] = None
                 ) -> None:
        if object_storage_config is not None or s3_config is not None:
            raise UsageError(f"{path_prefix}: object storage (S3/MSC) data is not supported — copy the "
                             ".bin/.idx files to a local or shared file system")
        # fast_cache_load / sequences_per_dataset / dtype_code only let megatron skip reading the header;
        # the header here is 34 bytes, so it is always read and checked.
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        """Opens and checks the pair (also used when unpickling)."""
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        idx_path, bin_path = get_idx_path(path_prefix), get_bin_path(path_prefix)
        missing = [p for p in (idx_path, bin_path) if not os.path.isfile(p)]
        if missing:
            raise UsageError([f"{p}: file not found — check the data path prefix {path_prefix!r}"
                              for p in missing])
        logger.info("Load the %s from %s", type(self).__name__, idx_path)
        self.index = _IndexReader(idx_path, multimodal)
        self.index.check_pointers()
        needed, have = self.index.bin_bytes_needed(), os.path.getsize(bin_path)
        if have < needed:
            raise UsageError(f"{bin_path}: data file is {have} bytes but its index needs {needed} — the "
                             "file is truncated; re-run preprocessing")
        if have > needed:
            raise UsageError(f"{bin_path}: data file is {have} bytes but its index ({idx_path}, token dtype "
                             f"{numpy.dtype(self.index.dtype).name}) describes {needed} — the dtype code is "
                             "wrong or the files do not belong together; re-run preprocessing")
        self.bin_reader = _MMapBinReader(bin_path) if mmap else _FileBinReader(bin_path)
        logger.info("> total number of sequences: %d", len(self.index))
        logger.info("> total number of documents: %d", self.index.document_count - 1)

    def __getstate__(self) -> Tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        self.initialize(*state)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, idx):
        if isinstance(idx, (int, numpy.integer)):
            pointer, length, mode = self.index[idx]
            tokens = self.bin_reader.read(self.index.dtype, int(length), int(pointer))
            return (tokens, mode) if mode is not None else tokens
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError("Slices into indexed_dataset must be contiguous")
            lengths = self.index.sequence_lengths[start:stop]
            if len(lengths) == 0:
                return ([], self.index.sequence_modes[start:stop]) if self.multimodal else []
            flat = self.bin_reader.read(self.index.dtype, int(lengths.sum()),
                                        int(self.index.sequence_pointers[start]))
            sequences = numpy.split(flat, numpy.cumsum(lengths)[:-1])
            return (sequences, self.index.sequence_modes[start:stop]) if self.multimodal else sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None):
        """Tokens `offset .. offset+length` of sequence `idx` (to its end when length is None)."""
        pointer, sequence_length, mode = self.index[idx]
        if length is None:
            length = int(sequence_length) - offset
        tokens = self.bin_reader.read(self.index.dtype, int(length),
                                      int(pointer) + offset * self.index.dtype_size)
        return (tokens, mode) if mode is not None else tokens

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 token count of every sequence."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 sequence index one past each document's end, starting with 0."""
        return self.index.document_indices

    def get_document_indices(self) -> numpy.ndarray:
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        self.index.document_indices = document_indices

    @property
    def sequence_modes(self) -> numpy.ndarray:
        """int8 mode of every sequence (multimodal datasets only)."""
        if self.index.sequence_modes is None:
            raise ValueError(f"{self.path_prefix}: sequence modes exist only for multimodal datasets")
        return self.index.sequence_modes

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both the `.idx` and the `.bin` of the prefix exist."""
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(get_bin_path(path_prefix))


class IndexedDatasetBuilder:
    """Writes a `.bin` as documents arrive and its `.idx` at `finalize` (megatron-core's builder).

    Lengths and document indices are kept in compact typed arrays (4 and 8 bytes per entry), not Python
    lists, so building an index for billions of tokens costs little memory.
    """

    def __init__(self, bin_path: str, dtype=numpy.int32, multimodal: bool = False) -> None:
        self.dtype = _scalar_type(dtype)
        self.multimodal = multimodal
        self.data_file = open(bin_path, "wb")
        self.sequence_lengths = array("i")
        self.document_indices = array("q", [0])
        self.sequence_modes = array("b") if multimodal else None

    def add_item(self, tensor, mode: int = 0) -> None:
        """Appends one sequence (a torch tensor, numpy array or list of ids)."""
        tokens = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.append(tokens.size)
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(self, tensor, lengths: Sequence[int], modes: Optional[Sequence[int]] = None) -> None:
        """Appends one document: its tokens back to back and the length of each of its sequences."""
        tokens = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(tokens.tobytes(order="C"))
        self.sequence_lengths.extend(lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def add_documents(self, token_bytes: bytes, lengths: Sequence[int], sequences_per_document: Sequence[int]
                      ) -> None:
        """Appends many documents at once: tokens already in this builder's dtype, every sequence length,
        and how many sequences each document has (0 for an empty document)."""
        self.data_file.write(token_bytes)
        base = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(numpy.asarray(lengths, dtype=numpy.int32).tobytes())
        ends = numpy.cumsum(numpy.asarray(sequences_per_document, dtype=numpy.int64)) + base
        self.document_indices.frombytes(ends.tobytes())
        if self.multimodal:
            self.sequence_modes.extend([0] * len(lengths))

    def end_document(self) -> None:
        """Closes the current document (after `add_item` calls)."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Appends a whole existing dataset (its index and its tokens), e.g. to merge partitions."""
        index = _IndexReader(get_idx_path(path_prefix), self.multimodal)
        if index.dtype != self.dtype:
            raise UsageError(f"{get_idx_path(path_prefix)}: token dtype {numpy.dtype(index.dtype).name} "
                             f"differs from the builder's {numpy.dtype(self.dtype).name} — merge datasets "
                             "made with the same tokenizer")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.frombytes(index.sequence_lengths.tobytes())
        self.document_indices.frombytes((index.document_indices[1:] + offset).tobytes())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        with open(get_bin_path(path_prefix), "rb") as stream:
            shutil.copyfileobj(stream, self.data_file, 16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Closes the `.bin` and writes the `.idx`."""
        self.data_file.close()
        lengths = numpy.frombuffer(self.sequence_lengths, dtype=numpy.int32)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        if len(lengths) > 1:
            numpy.cumsum(lengths[:-1], dtype=numpy.int64, out=pointers[1:])
        pointers *= DType.size(self.dtype)
        with open(idx_path, "wb") as stream:
            stream.write(_HEADER.pack(_INDEX_MAGIC, _INDEX_VERSION, DType.code_from_dtype(self.dtype),
                                      len(lengths), len(self.document_indices)))
            stream.write(lengths.tobytes())
            stream.write(pointers.tobytes())
            stream.write(numpy.frombuffer(self.document_indices, dtype=numpy.int64).tobytes())
            if self.multimodal:
                stream.write(numpy.frombuffer(self.sequence_modes, dtype=numpy.int8).tobytes())
