"""Hugging Face export: a directory that plain ``AutoModelForCausalLM.from_pretrained`` loads.

Two ways in, one writer (``hf_shards.py``): ``export_hf`` has every rank of a live (FSDP2/TP/EP-sharded) model
write its own safetensors shard — whole layers, gathered one tensor at a time — so no host ever holds the
model; ``convert_checkpoint`` reads the "model" entry of one of our DCP checkpoints a shard at a time (in one
process, or split over the ranks of a ``torchrun``), with the model config and tokenizer the checkpoint
carries. The config files are transformers' own (``save_pretrained`` with no weights, so a model's save
overrides still apply), the shards carry what ``save_pretrained`` would write, and
``model.safetensors.index.json`` maps every key to its file. The directory appears under its final name
only when complete (written as ``OUT.tmp``, then renamed); a failure on any rank removes ``OUT.tmp``.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from fsdp2_backend.usage_errors import RunStopped, UsageError
from fsdp2_backend.checkpoint import dirs
from fsdp2_backend.checkpoint import hf_shards
from fsdp2_backend.checkpoint.atomic import publish
from megatron_compat.data.utils import barrier, rank_zero_first

logger = logging.getLogger(__name__)

_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".distcp")
# an offline conversion's shard size: one shard is what a converting process holds at a time
DEFAULT_SHARD_BYTES = 5 * 2 ** 30


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Writes ``model`` (sharded or not; an HF PreTrainedModel) as an HF directory (collective: every rank
    writes one shard of whole layers)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # here: DCP costs ~0.1 s to import

    from fsdp2_backend.distributed.console import print_rank0

    started = time.perf_counter()
    out_dir = Path(out_dir)
    rank, world = _rank_world()
    print_rank0(f"exporting HF weights to {out_dir} (each of {world} rank(s) writes its shard)")
    state_dict = get_model_state_dict(model)  # this rank's pieces (DTensors): nothing is copied yet
    sources = hf_shards.tied_sources(model)
    shards = hf_shards.plan_shards(hf_shards.unique_sizes(state_dict, sources), world)
    names = hf_shards.shard_names(shards)

    def write_mine(tmp: Path) -> list:
        tensors = hf_shards.gather_owned(state_dict, shards, rank, sources)  # collective
        if not shards[rank]:
            return []
        return [(names[rank], hf_shards.write_shard(model, tensors, tmp / names[rank]))]

    _write_hf_dir(model, out_dir, write_mine, tokenizer)
    print_rank0(f"  exported HF weights to {out_dir} in {time.perf_counter() - started:.2f}s")
    return out_dir


def write_hf_dir(model: torch.nn.Module, state_dict: dict, out_dir: Path, tokenizer: Any = None,
                 shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Writes a full in-memory ``state_dict`` with ``model``'s HF files (``model`` may live on the meta device;
    one process), in shards of at most ``shard_bytes`` (a tensor larger than that is a shard of its own)."""
    sources = hf_shards.tied_sources(model)
    sizes = hf_shards.unique_sizes(state_dict, sources)
    parts = max(1, math.ceil(sum(sizes.values()) / shard_bytes))
    _write_hf_dir(model, Path(out_dir), lambda tmp: hf_shards.write_shards_sequentially(
        model, sizes, parts, lambda keys: {k: state_dict[k] for k in keys}, tmp), tokenizer)


def _write_hf_dir(model: torch.nn.Module, out_dir: Path, write_mine: Callable[[Path], list],
                  tokenizer: Any = None) -> None:
    """The one export sequence (collective when a process group exists): rank 0 makes ``OUT.tmp`` and writes
    the config files; every rank writes its shards there (``write_mine``); rank 0 writes the index and the
    tokenizer and renames ``OUT.tmp`` to ``OUT``. A failure anywhere reaches every rank and removes ``OUT.tmp``."""
    import torch.distributed as dist

    rank, world = _rank_world()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    rank_zero_first(lambda: _prepare_tmp(out_dir, tmp), others=False, what="HF export")
    error: Optional[BaseException] = None
    written: list = []
    try:
        # the config files (rank 0), and every rank runs the model's save hooks (e.g. step35's key mapping)
        with _no_progress_bar():  # its "Writing model shards: 0it" bar over no shards (ours are written below)
            model.save_pretrained(str(tmp), state_dict={}, is_main_process=rank == 0)
    except Exception as exc:
        error = exc
    try:
        barrier(error, "HF export")  # the shard writers below are collective: nobody enters them alone
        written = write_mine(tmp)
    except Exception as exc:
        error = exc
    try:
        # what each rank wrote, or why it failed ("" when not for lack of space or permission): a full disk met
        # by any writer is the one line every rank stops with, rank 0 (the one that prints) included
        failures: List[Optional[str]] = [None if error is None else str(export_stopped(error, out_dir) or "")]
        if world > 1:
            gathered: List[Any] = [None] * world
            dist.all_gather_object(gathered, (written, failures[0]))
            written = [entry for part, _ in gathered for entry in part]
            failures = [why for _, why in gathered]
        if error is not None:
            raise error
        if any(why is not None for why in failures):
            storage = next((why for why in failures if why), None)
            raise (RunStopped(storage) if storage else
                   UsageError("HF export failed on another rank — see that rank's error"))
        rank_zero_first(lambda: _commit(model, tmp, out_dir, written, tokenizer), others=False,
                        what="HF export")
    except BaseException as exc:
        if rank == 0:  # nothing half-written stays behind
            shutil.rmtree(tmp, ignore_errors=True)
        stopped = export_stopped(exc, out_dir)
        if stopped is not None:  # a full disk or a lost permission: one line, as for a checkpoint save
            raise stopped from None
        raise


@contextlib.contextmanager
def _no_progress_bar():
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def export_stopped(exc: BaseException, out_dir: Path) -> Optional[Exception]:
    """A RunStopped naming ``out_dir`` when ``exc`` is a storage failure (an OSError anywhere in its chain, or
    safetensors' "... (os error 28)", which carries no errno), else None."""
    import errno as errnos
    import re

    from fsdp2_backend.checkpoint.commit import storage_error
    from fsdp2_backend.usage_errors import RunStopped

    error = storage_error(exc) if isinstance(exc, Exception) else None
    found = re.search(r"\(os error (\d+)\)", str(exc))
    if error is None and found:
        error = OSError(int(found[1]), os.strerror(int(found[1])))
    if error is None or error.errno not in (errnos.ENOSPC, errnos.EDQUOT, errnos.EFBIG, errnos.EACCES,
                                            errnos.EPERM, errnos.EROFS):
        return None
    return RunStopped(f"{out_dir}: writing the Hugging Face export failed ({error.strerror or error}); nothing is "
                      f"left behind — free space or fix permissions there, then export again (tools/"
                      f"convert_checkpoint.py CHECKPOINT {out_dir} converts a saved checkpoint)")


def _prepare_tmp(out_dir: Path, tmp: Path) -> None:
    if out_dir.is_dir() and any(child.is_dir() for child in out_dir.iterdir()):
        # An HF directory is flat; this one may be an output or checkpoint directory: never delete it.
        raise UsageError(f"{out_dir}: exists and holds directories, so it is no earlier HF export to replace "
                         f"— export to a new directory (e.g. OUTPUT_DIR/hf)")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)


def _commit(model: torch.nn.Module, tmp: Path, out_dir: Path, written: list, tokenizer: Any) -> None:
    hf_shards.write_index(tmp, sorted(written), _num_parameters(model))
    save_tokenizer(tokenizer, tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    publish(tmp, out_dir)  # the shards, the index and the directory fsync'd, then one rename


def _num_parameters(model: torch.nn.Module) -> int:
    """The unique parameters' global count (DTensors report their global numel; meta tensors their shape)."""
    return sum(p.numel() for p in model.parameters())


def align_special_tokens(model_config: Any, tokenizer: Any, generation_config: Any = None) -> None:
    """A model built from Megatron flags has its model type's default special tokens (Llama's eos 2, whatever token
    that is in this tokenizer): give its config and generation config the tokenizer's instead, so that the export
    stops generating at the end of a document. eos = the tokenizer's end-of-document (Megatron's eod), bos = its
    bos (None when it has none); the generation config's pad = its pad, else eos. The model config's pad_token_id
    is left alone: it is the embedding's padding_idx (no gradient for that row), so changing it would make a
    resumed run's model differ from the one built at the start."""
    eod = getattr(tokenizer, "eod", None)
    if eod is None or model_config is None:
        return
    bos, pad = getattr(tokenizer, "bos", None), getattr(tokenizer, "pad", None)
    for target in (model_config, generation_config):
        if target is not None:
            target.eos_token_id = int(eod)
            target.bos_token_id = None if bos is None else int(bos)
    if generation_config is not None:
        generation_config.pad_token_id = int(eod) if pad is None else int(pad)


def save_tokenizer(tokenizer: Any, out_dir: Path) -> None:
    """Writes the tokenizer files into ``out_dir``: from an HF tokenizer, a Megatron-surface wrapper of one
    (``.hf``), or a directory (its files minus weights and model configs). Others are skipped, with a warning."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        for path in Path(tokenizer).iterdir():
            if path.is_file() and path.name not in _CONFIG_FILES and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, out_dir / path.name)
        return
    hf_tokenizer = tokenizer if hasattr(tokenizer, "save_pretrained") else getattr(tokenizer, "hf", None)
    if hasattr(hf_tokenizer, "save_pretrained"):
        hf_tokenizer.save_pretrained(str(out_dir))
    else:
        logger.warning("a %s cannot be written as HF tokenizer files; pass its directory instead to keep it "
                       "with the weights", type(tokenizer).__name__)


def load_model_state_dict(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full (unsharded) model weights of one of our checkpoints, read in this process only (through the
    allow-list, as every read of a checkpoint directory)."""
    checkpoint = Path(checkpoint)
    return _read_model_tensors(checkpoint, _model_tensors(checkpoint))


def convert_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                       dtype: Optional[torch.dtype] = None, shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Converts a checkpoint (an ``iter_*`` dir, or a save dir: its newest complete one) to an HF dir, one
    shard of at most ``shard_bytes`` read and written at a time; under a process group (``torchrun``) the
    ranks share the shards (collective)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    resolved = dirs.resolve_checkpoint(checkpoint)
    if resolved is None:
        raise UsageError([f"{checkpoint}: no complete checkpoint there (no iter_* directory with "
                          f"{dirs.META_FILE}) — pass an iter_* directory or the --save directory of a run"])
    hf_meta = resolved / dirs.HF_META_DIR
    if not (hf_meta / "config.json").is_file():
        raise UsageError([f"{resolved}: the checkpoint carries no model config ({dirs.HF_META_DIR}/config."
                          f"json) — it was saved without one; re-save it with the model's config"])
    config = AutoConfig.from_pretrained(str(hf_meta))
    if dtype is not None:
        config.dtype = dtype
    with torch.device("meta"):  # only the class, config and tied-weight rules are needed, not weights
        model = AutoModelForCausalLM.from_config(config)
    _run_scales(model, resolved)
    metadata = _model_tensors(resolved)
    sources = hf_shards.tied_sources(model)
    sizes, seen = {}, set()
    for key, (shape, saved_dtype) in metadata.items():
        target = dtype if dtype is not None and saved_dtype.is_floating_point else saved_dtype
        source = sources.get(key, key)
        sizes[key] = 0 if source in seen else math.prod(shape) * target.itemsize
        seen.add(source)
    rank, world = _rank_world()
    parts = max(world, math.ceil(sum(sizes.values()) / shard_bytes))

    def load(keys: List[str]) -> Dict[str, torch.Tensor]:
        tensors = _read_model_tensors(resolved, {k: metadata[k] for k in keys})
        if dtype is not None:
            tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
        first: Dict[Any, str] = {}
        for key in keys:  # tied names share one tensor, as save_pretrained expects to find them
            source = sources.get(key, key)
            if source in first:
                tensors[key] = tensors[first[source]]
            first.setdefault(source, key)
        return tensors

    _write_hf_dir(model, Path(out_dir), lambda tmp: hf_shards.write_shards_sequentially(
        model, sizes, parts, load, tmp, rank=rank, world=world), tokenizer=hf_meta)
    return Path(out_dir)


def _run_scales(model: torch.nn.Module, checkpoint: Path) -> None:
    """The MLA latent scales the run trained with (its run_config.json: model.mla_scale_*), recorded on ``model``
    so the shard writer folds them into the up-projections, as the live export does."""
    import json

    from fsdp2_backend.models.mla_lora_scale import record_scales

    try:
        run = json.loads((checkpoint / dirs.RUN_CONFIG_FILE).read_text(encoding="utf-8")).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return
    record_scales(model, bool(run.get("mla_scale_q_lora")), bool(run.get("mla_scale_kv_lora")))


def _model_tensors(checkpoint: Path) -> Dict[str, tuple]:
    """The checkpoint's model tensors: name → (global shape, dtype), from the DCP metadata (read through the
    allow-list: a checkpoint directory from elsewhere runs no code)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from megatron_compat.checkpoint.safe_pickle import OWN, SafeFileSystemReader

    out = {}
    for key, meta in SafeFileSystemReader(str(checkpoint), kind=OWN).read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            out[key[len("model."):]] = (tuple(meta.size), meta.properties.dtype)
    return out


def _read_model_tensors(checkpoint: Path, wanted: Mapping[str, tuple]) -> Dict[str, torch.Tensor]:
    """The full tensors ``wanted`` (name → shape, dtype) of the checkpoint's model, read in this process only."""
    from torch.distributed.checkpoint import load

    from megatron_compat.checkpoint.safe_pickle import OWN, SafeFileSystemReader, SafeLoadPlanner

    state = {"model": {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in wanted.items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        load(state, storage_reader=SafeFileSystemReader(str(checkpoint), kind=OWN),
             planner=SafeLoadPlanner(checkpoint, kind=OWN), no_dist=True)
    return state["model"]
