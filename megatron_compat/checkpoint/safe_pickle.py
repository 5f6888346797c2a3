"""The one door through which a pickle this project did not write is read: Megatron-LM's ``common.pt``, legacy
``mp_rank_*/model_optim_rng.pt``, the distributed optimizer's and the RNG's pickled objects inside DCP files, and
DCP's ``.metadata``. Only what Megatron-LM / megatron-core really save is rebuilt; any other global (``posix.system``,
``builtins.eval``, ``subprocess.Popen``, ...) is refused with one line naming the file, before it is called.

What is allowed:

- torch zip files (``torch.save``): ``torch.load(weights_only=True)`` — torch's own allow-list (tensor and storage
  rebuilds, dtypes, ``torch.Size``, ``OrderedDict``, plain containers) — plus, through
  ``torch.serialization.safe_globals``: ``argparse.Namespace`` (the saved args), the standard library's enums that
  Megatron-LM's own parser puts in them (``signal.Signals``: ``exit_signal`` defaults to SIGTERM since core_r0.16, so
  every genuine checkpoint holds it; an enum is rebuilt by a value lookup, which runs nothing), numpy's arrays,
  dtypes and scalars (the RNG states, under numpy 1's ``numpy.core`` and numpy 2's ``numpy._core`` names), and
  megatron's own classes
  (``megatron.*``: enums such as ``ModelType`` / ``AttnBackend``, config dataclasses) as inert stand-ins that only
  keep their constructor arguments and state — megatron is never imported (it is not a run-time dependency). The
  globals are listed first (``get_unsafe_globals_in_checkpoint``), so a refused one is named before anything loads.
- raw pickles (DCP's ``.metadata``, written by ``pickle.dump``): a ``pickle.Unpickler`` whose ``find_class``
  resolves only DCP's metadata dataclasses and enums, ``torch.Size``, torch dtypes / layouts / memory formats,
  ``OrderedDict``, pathlib's paths (the writer's checkpoint id) and inert builtins.
- DCP reads go through `SafeFileSystemReader` (its ``.metadata``) and `SafeLoadPlanner` (byte entries: torch's
  ``DefaultLoadPlanner.load_bytes`` unpickles them with ``weights_only=False``).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import io
import os
import pickle
import re
import signal
from pathlib import Path
from typing import Any, BinaryIO, Union

import numpy as np
import torch

from fsdp2_backend.usage_errors import UsageError

_STANDIN_PREFIXES = ("megatron.",)  # Megatron-LM / megatron-core's own classes: never imported, never called


class ForeignPickleRefused(UsageError):
    """A foreign pickle holds a global outside the allow-list."""


MEGATRON = "a Megatron checkpoint"
OWN = "a checkpoint of this project"  # this project's own DCP checkpoints read through the same door


def refusal(where: Any, name: str, kind: str = MEGATRON) -> ForeignPickleRefused:
    return ForeignPickleRefused(f"{where}: holds a pickled {name}, which is not part of {kind} — "
                               f"refusing to load it (loading it could run code)")


class MegatronStandIn:
    """An inert stand-in for one of megatron's classes: keeps what the pickle gave it, runs nothing."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__qualname__} {getattr(self, 'args', '')}>"


_STANDINS: dict[str, type] = {}


def _standin(full_name: str) -> type:
    if full_name not in _STANDINS:
        module, _, name = full_name.rpartition(".")
        _STANDINS[full_name] = type(name, (MegatronStandIn,), {"__module__": module, "__qualname__": name})
    return _STANDINS[full_name]


def _numpy_globals() -> dict[str, Any]:
    """numpy's pickle entry points as numpy 1 and numpy 2 name them (an RNG state is a uint32 array)."""
    try:
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct, scalar

    out = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for core in ("numpy.core", "numpy._core"):
        out[f"{core}.multiarray._reconstruct"] = _reconstruct
        out[f"{core}.multiarray.scalar"] = scalar
    for dtype_class in {type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGUSV"}:  # numpy 2's numpy.dtypes.*DType
        out[f"numpy.dtypes.{dtype_class.__name__}"] = dtype_class
    return out


# The standard library's enums a genuine args namespace holds (tests/data/megatron_genuine_args/*/args.json lists
# every non-builtin field Megatron-LM's parse_args + validate_args produce): looked up by value, never called code.
STDLIB_ENUMS: dict[str, type] = {"signal.Signals": signal.Signals}


def _allowed_zip_globals() -> dict[str, Any]:
    return {"argparse.Namespace": argparse.Namespace, **STDLIB_ENUMS, **_numpy_globals()}


def _open(source: Union[str, os.PathLike, BinaryIO]):
    return open(source, "rb") if isinstance(source, (str, os.PathLike)) else source


_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|<(?:class|function|built-in function) '?([\w.]+)")


def load_torch_file(source: Union[str, os.PathLike, BinaryIO], where: Any = None, mmap: bool = False,
                    kind: str = MEGATRON) -> Any:
    """``torch.load`` of a foreign ``torch.save`` file (path or seekable file object) through the allow-list;
    ``where`` names it in the refusal (default: the path)."""
    where = source if where is None else where
    allowed = _allowed_zip_globals()
    wanted = []
    try:
        with _Rewound(_open(source), own=isinstance(source, (str, os.PathLike))) as f:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception as exc:  # not a torch zip file: the legacy format is not something Megatron-LM writes
        raise UsageError(f"{where}: not a torch.save file this project can read ({str(exc).splitlines()[0]}) — "
                         f"is the checkpoint complete?") from None
    if any(name.startswith("numpy.") for name in names):  # a dtype's BUILD needs its class, which is not listed
        wanted += [(v, k) for k, v in allowed.items() if k.startswith("numpy.dtypes.") and k not in names]
    for name in names:
        if name in allowed:
            wanted.append((allowed[name], name))
        elif name.startswith(_STANDIN_PREFIXES):
            wanted.append((_standin(name), name))
        else:
            raise refusal(where, name, kind)
    try:
        with torch.serialization.safe_globals(wanted):
            if isinstance(source, (str, os.PathLike)):
                return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
            source.seek(0)
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's restricted unpickler refused something the listing missed
        found = _UNSUPPORTED_GLOBAL.search(str(exc))
        raise refusal(where, (found.group(1) or found.group(2)) if found else "object torch's weights-only loader "
                      "refuses", kind) from None


class _Rewound:
    """A file object seeked back to its start on the way in and out (a BytesIO read twice)."""

    def __init__(self, f, own: bool):
        self.f, self.own = f, own

    def __enter__(self):
        self.f.seek(0)
        return self.f

    def __exit__(self, *exc):
        if self.own:
            self.f.close()
        else:
            self.f.seek(0)


def _dcp_classes() -> dict[str, Any]:
    """DCP's metadata records: the dataclasses and enums of its metadata / planner modules, and _StorageInfo."""
    from torch.distributed.checkpoint import filesystem, metadata, planner

    out = {"torch.distributed.checkpoint.filesystem._StorageInfo": filesystem._StorageInfo}
    for module in (metadata, planner):
        for name, value in vars(module).items():
            if isinstance(value, type) and value.__module__ == module.__name__ and (
                    dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                out[f"{module.__name__}.{name}"] = value
    return out


def _path_classes() -> dict[str, type]:
    """pathlib's path classes (DCP's StorageMeta keeps the writer's checkpoint_id, a Path), by their pickled names
    (``pathlib`` before Python 3.13, ``pathlib._local`` after): constructing a path runs nothing."""
    import pathlib

    classes = (pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path, pathlib.PosixPath,
               pathlib.WindowsPath)
    return {f"{module}.{c.__name__}": c for c in classes for module in ("pathlib", "pathlib._local")}


_INERT_BUILTINS = {"set": set, "frozenset": frozenset, "bytearray": bytearray, "complex": complex, "slice": slice}


class RestrictedUnpickler(pickle.Unpickler):
    """A plain pickle's unpickler resolving only the allow-list (``find_class`` is where every global of a pickle
    is looked up: GLOBAL, STACK_GLOBAL, INST, OBJ)."""

    def __init__(self, file, where: Any, kind: str = MEGATRON):
        super().__init__(file)
        self.where, self.kind = where, kind
        self.allowed = {**_dcp_classes(), "torch.Size": torch.Size, "collections.OrderedDict": collections.OrderedDict,
                        "torch.serialization._get_layout": torch.serialization._get_layout,
                        "_codecs.encode": __import__("_codecs").encode, **_path_classes(),
                        **{f"builtins.{k}": v for k, v in _INERT_BUILTINS.items()}}

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if full in self.allowed:
            return self.allowed[full]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if full.startswith(_STANDIN_PREFIXES):
            return _standin(full)
        raise refusal(self.where, full, self.kind)

    def persistent_load(self, pid):
        raise refusal(self.where, f"persistent reference {pid!r}", self.kind)


def load_plain_pickle(path: Union[str, os.PathLike], where: Any = None) -> Any:
    with open(path, "rb") as f:
        return RestrictedUnpickler(f, path if where is None else where).load()


def _reader_classes():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """torch's FileSystemReader, reading ``.metadata`` through the restricted unpickler."""

        def __init__(self, path, *args, kind: str = MEGATRON, **kwargs):
            super().__init__(path, *args, **kwargs)
            self.kind = kind

        def read_metadata(self, *args, **kwargs):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = RestrictedUnpickler(f, Path(str(path)), self.kind).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner whose byte entries (pickled objects) load through the allow-list."""

        def __init__(self, where: Any, kind: str = MEGATRON, **kwargs):
            super().__init__(**kwargs)
            self.where, self.kind = where, kind

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_torch_file(value, where=f"{self.where} (its entry {fqn})", kind=self.kind)
            if self.flatten_state_dict:  # as torch's own load_bytes places it in the nested state dict
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.original_state_dict[fqn] = loaded

    return SafeFileSystemReader, SafeLoadPlanner


SafeFileSystemReader, SafeLoadPlanner = _reader_classes()


def dcp_load(state: dict, it_dir: Path) -> dict:
    """``torch.distributed.checkpoint.load`` of ``state``'s keys from ``it_dir`` without a process group, pickled
    entries included, every pickle through the allow-list. Byte entries come back as the objects they hold."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        load(state, storage_reader=SafeFileSystemReader(str(it_dir)),
             planner=SafeLoadPlanner(it_dir, flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what a rank raised: a refusal is reported as itself
        for failure, _ in exc.failures.values():
            if isinstance(failure, UsageError):
                raise failure from None
        raise
    return state


def dcp_metadata(it_dir: Path):
    return SafeFileSystemReader(str(it_dir)).read_metadata()


__all__ = ["MEGATRON", "OWN", "ForeignPickleRefused", "MegatronStandIn", "load_torch_file", "load_plain_pickle", "RestrictedUnpickler",
           "SafeFileSystemReader", "SafeLoadPlanner", "dcp_load", "dcp_metadata"]
