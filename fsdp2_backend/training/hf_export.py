"""Hugging Face export: a directory that plain ``AutoModelForCausalLM.from_pretrained`` loads.

Two ways in, one writer: ``export_hf`` gathers a live (FSDP2/TP-sharded) model's full state dict on rank 0
(``get_model_state_dict(full_state_dict=True, cpu_offload=True)``); ``convert_checkpoint`` reads the
"model" entry of one of our DCP checkpoints in a single process (``_load_state_dict_from_keys``), with the
model config and tokenizer the checkpoint carries. Both hand the state dict to transformers'
``save_pretrained(state_dict=...)`` so that safetensors sharding, tied-weight handling and the config
files are exactly what transformers itself writes. The directory appears under its final name only
when complete (written as ``OUT.tmp``, then renamed).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.training import checkpoint_io as io
from megatron_compat.data.utils import rank_zero_first

logger = logging.getLogger(__name__)

_CONFIG_FILES = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".distcp")


def export_hf(model: torch.nn.Module, out_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Writes ``model`` (sharded or not; an HF PreTrainedModel) as an HF directory (collective)."""
    from fsdp2_backend.distributed.console import print_rank0

    started = time.perf_counter()
    out_dir = Path(out_dir)
    print_rank0(f"exporting HF weights to {out_dir} (gathering the full state dict)")
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # rank 0 writes; a failure there reaches every rank instead of leaving them waiting
    rank_zero_first(lambda: write_hf_dir(model, state_dict, out_dir, tokenizer), others=False, what="HF export")
    print_rank0(f"  exported HF weights to {out_dir} in {time.perf_counter() - started:.2f}s")
    return out_dir


def write_hf_dir(model: torch.nn.Module, state_dict: dict, out_dir: Path, tokenizer: Any = None) -> None:
    """Saves ``state_dict`` with ``model``'s ``save_pretrained`` (``model`` may live on the meta device),
    plus the tokenizer (an object with ``save_pretrained`` or a directory of tokenizer files)."""
    if out_dir.is_dir() and any(child.is_dir() for child in out_dir.iterdir()):
        # An HF directory is flat; this one may be an output or checkpoint directory: never delete it.
        raise UsageError(f"{out_dir}: exists and holds directories, so it is no earlier HF export to replace "
                         f"— export to a new directory (e.g. OUTPUT_DIR/hf)")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    from fsdp2_backend.models.mtp_layouts import to_checkpoint

    # MTP layers under the names of the checkpoint's own model (Qwen3-Next's `mtp.*`): models/mtp_layouts.py
    model.save_pretrained(str(tmp), state_dict=to_checkpoint(state_dict, model.config))
    save_tokenizer(tokenizer, tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


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
    """The full (unsharded) model weights of one of our checkpoints, read in this process only."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process.*")
        return _load_state_dict_from_keys({"model"}, checkpoint_id=str(checkpoint))["model"]


def convert_checkpoint(checkpoint: str | os.PathLike, out_dir: str | os.PathLike,
                       dtype: Optional[torch.dtype] = None) -> Path:
    """Converts a checkpoint (an ``iter_*`` dir, or a save dir: its newest complete one) to an HF dir."""
    from transformers import AutoConfig, AutoModelForCausalLM

    resolved = io.resolve_checkpoint(checkpoint)
    if resolved is None:
        raise UsageError([f"{checkpoint}: no complete checkpoint there (no iter_* directory with "
                          f"{io.META_FILE}) — pass an iter_* directory or the --save directory of a run"])
    hf_meta = resolved / io.HF_META_DIR
    if not (hf_meta / "config.json").is_file():
        raise UsageError([f"{resolved}: the checkpoint carries no model config ({io.HF_META_DIR}/config."
                          f"json) — it was saved without one; re-save it with the model's config"])
    state_dict = load_model_state_dict(resolved)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    config = AutoConfig.from_pretrained(str(hf_meta))
    if dtype is not None:
        config.dtype = dtype
    with torch.device("meta"):  # only the class, config and tied-weight rules are needed, not weights
        model = AutoModelForCausalLM.from_config(config)
    write_hf_dir(model, state_dict, Path(out_dir), tokenizer=hf_meta)
    return Path(out_dir)
