"""The model ids: one line each in `SPEC_MODULES`, each naming the folder whose `spec.py` holds its `ModelSpec`.

`model.model_id` unset runs the native transformers causal LM of the HF directory; a model id runs the spec's
implementation. Everything else that knows about ids reads them here: the schema's choices (`model_id_names`),
config validation, the parallel stages, the model loader, the Megatron front end (`specs`, `model_spec`,
`spec_for_model_type`). Adding a model id is one folder `models/<id>/` (its model and `spec.py`) and one line below.

Importing this module imports no torch and no model code (config validation and the schema read it; each spec
names its implementation lazily, `models/spec.py`). `register_spec` adds a spec for the length of a `with`
block: tests use it to see a new id validated, built and trained from its spec alone.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Dict, Iterator, Optional, Tuple

from fsdp2_backend.models.spec import ModelSpec
from fsdp2_backend.usage_errors import UsageError

SPEC_MODULES = (  # one line per model id: fsdp2_backend/models/<id>/spec.py (this order is the documented one)
    "gpt_oss",
    "qwen3",
    "qwen3_moe",
    "qwen3_next",
    "step35",
    "mamba3",
    "minimax_m27",
    "deepseek_v3",
    "mixtral",
    "qwen2_moe",
    "deepseek_v4",
    "glm52",
    "longcat_flash_ngram",
)


def _load() -> Dict[str, ModelSpec]:
    loaded = {}
    for folder in SPEC_MODULES:
        spec = importlib.import_module(f"fsdp2_backend.models.{folder}.spec").SPEC
        assert spec.model_id == folder, f"models/{folder}/spec.py declares model_id {spec.model_id}"
        loaded[folder] = spec
    return loaded


_SPECS: Dict[str, ModelSpec] = _load()


def specs() -> Tuple[ModelSpec, ...]:
    """Every registered spec, in registry order."""
    return tuple(_SPECS.values())


def registered_model_ids() -> tuple:
    """The model ids that have an implementation."""
    return tuple(_SPECS)


def model_id_aliases() -> Dict[str, Tuple[str, str]]:
    """Other names of the ids: {name: (model id, whose name it is)}."""
    return {name: (spec.model_id, whose) for spec in _SPECS.values() for name, whose in spec.aliases.items()}


def model_id_names() -> tuple:
    """What `model.model_id` accepts: the ids, then their other names (the schema's choices)."""
    return registered_model_ids() + tuple(model_id_aliases())


def canonical_model_id(model_id: Optional[str]) -> Optional[str]:
    """The id another name of it stands for (the id itself otherwise)."""
    return model_id_aliases().get(model_id, (model_id,))[0]


def model_spec(model_id: str) -> ModelSpec:
    """The spec for `model_id` (or another name of it); an unknown id is a usage error."""
    model_id = canonical_model_id(model_id)
    if model_id not in _SPECS:
        raise UsageError(f"model.model_id: '{model_id}' has no implementation in this project yet — use one of "
                         f"{', '.join(_SPECS)} or leave model_id unset to run the transformers model")
    return _SPECS[model_id]


def spec_of(model_id: Optional[str]) -> Optional[ModelSpec]:
    """The spec of a registered id (or another name of it); None for None or an unknown id (validation says so)."""
    return _SPECS.get(canonical_model_id(model_id)) if model_id else None


def spec_for_model_type(model_type: Optional[str]) -> Optional[ModelSpec]:
    """The spec that builds the HF model type `model_type` (the first registered), or None."""
    return next((spec for spec in _SPECS.values() if model_type in spec.hf_model_types), None)


def register_model_types() -> None:
    """Registers the HF config / model classes of the specs that have their own (`register_hf`) with transformers'
    Auto classes, so a saved directory of such a model type (e.g. "mamba3") loads."""
    for spec in _SPECS.values():
        if spec.register_hf is not None:
            spec.register_hf()


@contextlib.contextmanager
def register_spec(spec: ModelSpec) -> Iterator[ModelSpec]:
    """Registers `spec` for the length of the `with` block (tests: an id added by its spec alone)."""
    if spec.model_id in _SPECS:
        raise ValueError(f"model id {spec.model_id} is registered already")
    _SPECS[spec.model_id] = spec
    try:
        yield spec
    finally:
        del _SPECS[spec.model_id]
