"""One `Format` per kind of checkpoint directory a run meets, each able to tell a directory apart (`detect`), say what
it holds (`describe`), give the HF config keys of its model (`model_config`), the model arguments a run resuming from
it builds with (`model_args`), and read it into plain state (`read`):

- `OURS`: this backend's ``iter_*`` directories (DCP, `dirs`); `read` gives the full model weights (one process).
  Resuming one loads it through DCP straight into the sharded run (`reshards_in_place`: training's `checkpoint`).
- `HF`: a Hugging Face model directory (config.json and safetensors); `read` gives its weights.
- `MEGATRON_TORCH_DIST`, `MEGATRON_LEGACY`, `MEGATRON_FSDP_DTENSOR`, `MEGATRON_TORCH_DCP`: Megatron-LM's iteration
  directories (`megatron_compat/checkpoint/`); `read` gives a `MegatronState` (full tensors in HF names, the Adam
  moments, scheduler, iteration, RNG) that training applies.

`detect_format(path)` asks them in turn. Detection is torch-free except telling fsdp_dtensor from torch_dcp, which
takes the saved args (as Megatron-LM's own ``_get_checkpoint_format`` does). Readers are imported when used.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from fsdp2_backend.checkpoint.dirs import FORMAT, HF_META_DIR, META_FILE, is_complete_checkpoint
from fsdp2_backend.config.weight_files import read_config_json, safetensors_files
from megatron_compat.checkpoint.layout import checkpoint_format


class Format:
    """A kind of checkpoint directory. `reshards_in_place`: DCP loads it straight into a sharded run (ours); else
    `read` gives full tensors the run applies."""

    name = ""
    reshards_in_place = False

    def detect(self, path: Path) -> bool:
        raise NotImplementedError

    def describe(self, path: Path) -> str:
        raise NotImplementedError

    def model_config(self, path: Path, errors: List[str]) -> Optional[Dict[str, Any]]:
        """The HF config keys of the model the checkpoint holds (None: none; a problem reading it goes to errors)."""
        raise NotImplementedError

    def model_args(self, model_args: Any, path: Path) -> Any:
        """The run's ModelArguments when it resumes from `path` (the model is the checkpoint's)."""
        raise NotImplementedError

    def read(self, path: Path, **options) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<checkpoint format {self.name}>"


class _Ours(Format):
    name = FORMAT
    reshards_in_place = True

    def detect(self, path: Path) -> bool:
        return is_complete_checkpoint(path)

    def describe(self, path: Path) -> str:
        try:
            meta = json.loads((Path(path) / META_FILE).read_text())
        except (OSError, ValueError):
            meta = {}
        parts = [f"saved by {meta.get('world_size', '?')} rank(s)"]
        parts += [f"with {what}" for what, key in (("optimizer state", "has_optimizer"), ("RNG states", "has_rng"))
                  if meta.get(key)]
        return f"this backend's {self.name} checkpoint of iteration {meta.get('iteration', '?')} ({', '.join(parts)})"

    def model_config(self, path: Path, errors: List[str]) -> Optional[Dict[str, Any]]:
        return read_config_json(str(Path(path) / HF_META_DIR), errors)

    def model_args(self, model_args: Any, path: Path) -> Any:
        if model_args.model_name_or_path:  # an HF directory given too: its model (the weights come from the load)
            return model_args
        # Architecture flags given too were checked against this config by validation: the checkpoint's wins.
        hf_meta = str(Path(path) / HF_META_DIR)
        return dataclasses.replace(model_args, model_name_or_path=hf_meta, train_from_scratch=True, architecture=None,
                                   tokenizer_name_or_path=model_args.tokenizer_name_or_path
                                   or (None if model_args.tokenizer_type else hf_meta))

    def read(self, path: Path, **options) -> Any:
        """The full (unsharded) model weights, in this process."""
        from fsdp2_backend.checkpoint.hf_export import load_model_state_dict

        return load_model_state_dict(path)


class _HuggingFace(Format):
    name = "hf"

    def detect(self, path: Path) -> bool:
        path = Path(path)
        return (path / "config.json").is_file() and bool(safetensors_files(str(path)))

    def describe(self, path: Path) -> str:
        model_type = (read_config_json(str(path), []) or {}).get("model_type", "?")
        return f"a Hugging Face model directory ({model_type}, {len(safetensors_files(str(path)))} safetensors file(s))"

    def model_config(self, path: Path, errors: List[str]) -> Optional[Dict[str, Any]]:
        return read_config_json(str(path), errors)

    def model_args(self, model_args: Any, path: Path) -> Any:
        return dataclasses.replace(model_args, model_name_or_path=str(path))

    def read(self, path: Path, **options) -> Any:
        """The weights of every safetensors file, by their saved names."""
        from safetensors.torch import load_file

        weights: Dict[str, Any] = {}
        for file in safetensors_files(str(path)):
            weights.update(load_file(str(file)))
        return weights


class _Megatron(Format):
    """A Megatron-LM iteration directory in one on-disk format (`megatron_compat.checkpoint.layout`)."""

    def __init__(self, name: str, on_disk: str, fsdp: Optional[bool] = None):
        self.name, self.on_disk, self.fsdp = name, on_disk, fsdp

    def detect(self, path: Path) -> bool:
        path = Path(path)
        if checkpoint_format(path) != self.on_disk:
            return False
        return self.fsdp is None or _saved_by_megatron_fsdp(str(path)) == self.fsdp

    def describe(self, path: Path) -> str:
        return f"a Megatron-LM {self.name} checkpoint ({Path(path).name})"

    def model_config(self, path: Path, errors: List[str]) -> Optional[Dict[str, Any]]:
        """The HF config its saved args describe (reads the checkpoint with torch; cached)."""
        from megatron_compat.checkpoint.resume import megatron_architecture

        return dict(megatron_architecture(str(path))[0])

    def model_args(self, model_args: Any, path: Path) -> Any:
        from megatron_compat.checkpoint.resume import megatron_model_args

        return megatron_model_args(model_args, Path(path))

    def read(self, path: Path, **options) -> Any:
        """A MegatronState (`megatron_compat.checkpoint.resume.read_megatron_state`; options: load_optim, load_rng,
        finetune, rank)."""
        from megatron_compat.checkpoint.resume import read_megatron_state

        return read_megatron_state(Path(path), **options)


@functools.lru_cache(maxsize=8)
def _saved_by_megatron_fsdp(it_dir: str) -> bool:
    from megatron_compat.checkpoint.dcp_format import read_dcp_common
    from megatron_compat.checkpoint.fsdp_dtensor import is_fsdp_dtensor

    return is_fsdp_dtensor(read_dcp_common(Path(it_dir)).get("args"))


OURS: Format = _Ours()
HF: Format = _HuggingFace()
MEGATRON_TORCH_DIST: Format = _Megatron("torch_dist", "torch_dist")
MEGATRON_LEGACY: Format = _Megatron("legacy (torch)", "torch")
MEGATRON_FSDP_DTENSOR: Format = _Megatron("fsdp_dtensor", "torch_dcp", fsdp=True)
MEGATRON_TORCH_DCP: Format = _Megatron("torch_dcp", "torch_dcp", fsdp=False)
FORMATS: Tuple[Format, ...] = (OURS, MEGATRON_TORCH_DIST, MEGATRON_LEGACY, MEGATRON_FSDP_DTENSOR, MEGATRON_TORCH_DCP,
                               HF)


def detect_format(path: Optional[Path]) -> Optional[Format]:
    """The format of the checkpoint directory `path` (one iteration's, or an HF directory), or None."""
    if path is None or not Path(path).is_dir():
        return None
    return next((fmt for fmt in FORMATS if fmt.detect(Path(path))), None)


__all__ = ["Format", "FORMATS", "OURS", "HF", "MEGATRON_TORCH_DIST", "MEGATRON_LEGACY", "MEGATRON_FSDP_DTENSOR",
           "MEGATRON_TORCH_DCP", "detect_format"]
