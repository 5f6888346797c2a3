"""From the model arguments to a parallelised causal LM holding the right weights.

Two ways, the same result:
- normal: build the full model on CPU (`from_pretrained` for the native transformers model, or the registry
  builder plus the safetensors loader), then let `parallelize` shard it;
- `init_model_with_meta_device`: build on the meta device, `parallelize` (shards of meta tensors), allocate
  only the local shards (`to_empty`), then fill them tensor by tensor — from the safetensors files, or by the
  seeded initialisation — so no rank ever holds the whole model.

Seeded initialisation (`train_from_scratch`, or no HF directory) runs the model's own HF `_init_weights` on
each module in HF's order (children first) from `torch.manual_seed(seed)`, on a full-size stand-in of the
module's tensors, and keeps this rank's shard: the weights are those of HF's `initialize_weights` whatever
the sharding.
"""
from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from fsdp2_backend.config import ModelArguments
from fsdp2_backend.distributed.dtensor import own_class, write_whole
from fsdp2_backend.usage_errors import UsageError
from fsdp2_backend.models.registry import model_spec, register_model_types, spec_for_model_type
from fsdp2_backend.models.spec import ModelSpec
from fsdp2_backend.models.nemotron_h import honour_time_step_limit

Parallelize = Callable[[nn.Module], nn.Module]


def load_hf_config(model_args: ModelArguments):
    """The HF config: from `model_name_or_path`, or built from `architecture`; checked against each other."""
    from transformers import AutoConfig

    arch = dict(model_args.architecture or {})
    if not _known_to_transformers(model_args.model_name_or_path, arch.get("model_type")):
        register_model_types()  # this project's own HF model types (e.g. "mamba3"), so their directories load
    if model_args.model_name_or_path:
        path = model_args.model_name_or_path
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
            if arch:
                return _config_from_architecture(arch)
            raise UsageError(f"model.model_name_or_path (--load): {path} has no config.json — point it at a "
                             f"Hugging Face model directory, or give the architecture flags to train from scratch")
        try:
            hf_config = AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code,
                                                   cache_dir=model_args.cache_dir, revision=model_args.model_revision,
                                                   token=model_args.hf_hub_token)
        except (OSError, ValueError) as exc:
            if "custom code" in str(exc) and not model_args.trust_remote_code:  # config.json's auto_map
                raise UsageError(f"model.model_name_or_path (--load): {os.path.join(path, 'config.json')} names "
                                 f"custom modelling code (auto_map), which runs only with model.trust_remote_code "
                                 f"(--trust-remote-code) — set it only for a directory you trust") from None
            raise UsageError(f"model.model_name_or_path (--load): cannot read an HF config from {path} "
                             f"({str(exc).splitlines()[0]}) — point it at a local Hugging Face model directory")
        _check_architecture(hf_config, arch)
        return hf_config
    if not arch:
        raise UsageError("model.model_name_or_path (--load): not set and no architecture given — give an HF "
                         "model directory or the Megatron architecture flags")
    return _config_from_architecture(arch)


def _known_to_transformers(path: Optional[str], model_type: Optional[str]) -> bool:
    """Whether the run's model type (config.json's in `path`, else the architecture's) is one transformers has: then
    registering this project's own types is not needed (importing their modules cost ~1 s of start-up)."""
    config_file = os.path.join(path, "config.json") if path else None
    if config_file and os.path.isfile(config_file):
        try:
            with open(config_file, encoding="utf-8") as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            return False
    if not model_type:
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _config_from_architecture(arch: Dict) -> object:
    from transformers import AutoConfig

    arch = dict(arch)
    model_type = arch.pop("model_type", None)
    if not model_type:
        raise UsageError("model.architecture: no model_type — say which HF model family to build (e.g. qwen3)")
    try:
        return AutoConfig.for_model(model_type, **{k: v for k, v in arch.items() if v is not None})
    except ValueError as exc:
        raise UsageError(f"model.architecture: model_type '{model_type}' is unknown to transformers ({exc}) — "
                         f"use an HF model type such as qwen3")


def _check_architecture(hf_config, arch: Dict) -> None:
    """Megatron flags that disagree with config.json are reported (the checkpoint would not fit)."""
    problems = []
    for key, want in arch.items():
        if want is None or key == "vocab_size" or not hasattr(hf_config, key):
            continue  # vocab rows may be padded or resized; unknown keys are the model's business
        have = getattr(hf_config, key)
        if have != want:
            problems.append(f"model.architecture.{key}: {want!r} disagrees with {have!r} in the checkpoint's "
                            f"config.json — fix the flag or drop it")
    if problems:
        raise UsageError(problems)


def weights_available(model_args: ModelArguments) -> bool:
    """True when weights are to be loaded (an HF directory with safetensors, and not training from scratch)."""
    path = model_args.model_name_or_path
    if model_args.train_from_scratch or not path or not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return bool(_safetensors_files(path))


def _safetensors_files(path: str) -> List[Path]:
    return sorted(Path(path).glob("*.safetensors")) if os.path.isdir(path) else []


def build_model(model_args: ModelArguments, hf_config, *, on_meta: bool) -> nn.Module:
    """The model's modules in fp32, weights not yet meaningful (on meta when `on_meta`)."""
    from transformers import AutoModelForCausalLM

    device = torch.device("meta") if on_meta else torch.device("cpu")
    with device:
        if model_args.model_id:
            return model_spec(model_args.model_id).build(hf_config).float()
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=model_args.trust_remote_code,
                                                dtype=torch.float32)


def _module_tensors(module: nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    yield from module.named_parameters(recurse=False)
    yield from ((n, b) for n, b in module.named_buffers(recurse=False) if b is not None)


def _assign_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Writes `full` (the whole tensor) into `target`, which may be a sharded DTensor: keep the local shard."""
    write_whole(target, full.to(dtype=target.dtype))  # every rank holds the same full tensor: no comms


@torch.no_grad()
def seeded_initialize(model: nn.Module, seed: int, *, buffers_only: bool = False) -> None:
    """HF's `initialize_weights` from `manual_seed(seed)`, written shard-wise into possibly sharded tensors.

    `buffers_only` recomputes just the buffers (e.g. rotary frequencies) after weights were loaded.
    """
    init_fn = getattr(model, "_init_weights", None)
    if init_fn is None:
        raise UsageError(f"model.train_from_scratch: {type(model).__name__} has no HF _init_weights — this model "
                         f"can only be loaded from a checkpoint")
    torch.manual_seed(seed)
    seen = set()
    for module in _children_first(model):
        names = list(_module_tensors(module))
        if not names:
            continue
        stand_in = _stand_in(module)
        fresh = {}
        for name, tensor in names:
            full = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")  # a DTensor's shape is global
            is_param = name in module._parameters
            if (is_param and (buffers_only or id(tensor) in seen)) or getattr(tensor, "_loaded_from_checkpoint", False):
                full._is_hf_initialized = True  # loaded or tied: HF's init functions skip flagged tensors
            else:
                fresh[name] = full
            seen.add(id(tensor))
            (stand_in._parameters if is_param else stand_in._buffers)[name] = (
                nn.Parameter(full, requires_grad=False) if is_param else full)
        if not fresh:
            continue
        stand_in.__dict__.pop("_is_hf_initialized", None)
        init_fn(stand_in)
        for name, full in fresh.items():
            written = stand_in._parameters.get(name, stand_in._buffers.get(name))
            _assign_full(getattr(module, name), written.data)


def _stand_in(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` as its own class (not FSDP's subclass), with tensor dicts of its own."""
    cls = own_class(module)
    stand_in = object.__new__(cls)
    stand_in.__dict__.update(module.__dict__)
    stand_in._parameters, stand_in._buffers = dict(module._parameters), dict(module._buffers)
    return stand_in


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _children_first(child)
    yield module


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str, new_rows: Optional[Callable] = None,
                     spec: Optional[ModelSpec] = None, hf_config=None) -> None:
    """Fills every parameter of `model` (full or sharded) from the safetensors files under `path`, one
    parameter at a time.

    Checkpoint keys equal parameter names unless `spec` maps them (`checkpoint_keys` / `from_checkpoint`).
    A parameter with more rows than its checkpoint tensor (a resized vocabulary) gets the checkpoint rows
    plus `new_rows(old_full, n_new)`.
    """
    from safetensors import safe_open

    from fsdp2_backend.models.fp8_blocks import SCALE_SUFFIX, block_size, dequantize

    spec = spec or native_checkpoint_layout(hf_config)  # transformers' own class: its checkpoint's key layout
    keys_of = (lambda name: spec.checkpoint_keys(name, hf_config)) if spec and spec.checkpoint_keys else \
        (lambda name: [name])
    block = block_size(hf_config) or (128, 128)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in _safetensors_files(path)]
        where = {key: handle for handle in handles for key in handle.keys()}

        def read(key):  # FP8 block-quantised keys (a `_scale_inv` beside them) dequantised as they stream
            tensor = where[key].get_tensor(key)
            if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and key + SCALE_SUFFIX in where:
                return dequantize(tensor, where[key + SCALE_SUFFIX].get_tensor(key + SCALE_SUFFIX), block)
            return tensor

        missing = []
        buffers = [(n, b, True) for n, b in model.named_buffers()]  # persistent ones the checkpoint holds
        for name, target, is_buffer in [(n, p, False) for n, p in model.named_parameters()] + buffers:
            keys = [name] if name in where else keys_of(name)  # a checkpoint in the in-memory layout as it is
            if any(key not in where for key in keys):
                if not is_buffer:
                    missing.append(name)
                continue
            tensors = {key: read(key) for key in keys}
            full = tensors[name] if name in tensors or not (spec and spec.from_checkpoint) else \
                spec.from_checkpoint(name, tensors, hf_config)
            if name in tensors and spec is not None and spec.stored_layout is not None:
                full = spec.stored_layout(name, full, hf_config)
            if full.shape[0] < target.shape[0] and full.shape[1:] == target.shape[1:] and new_rows:
                full = torch.cat([full.float(), new_rows(full.float(), target.shape[0] - full.shape[0])])
            if full.shape != target.shape:
                raise UsageError(f"model.model_name_or_path: {name} has shape {tuple(full.shape)} in {path} but the "
                                 f"model expects {tuple(target.shape)} — the checkpoint does not match the config")
            _assign_full(target, full)
            if is_buffer:
                target._loaded_from_checkpoint = True  # seeded_initialize(buffers_only) keeps it
    if missing:
        raise UsageError(f"model.model_name_or_path: {path} lacks {len(missing)} weights the model needs (first: "
                         f"{', '.join(missing[:3])}) — use a checkpoint of this model, or train_from_scratch")


def native_checkpoint_layout(hf_config) -> Optional[ModelSpec]:
    """For transformers' own class (`model_id` unset): the spec whose checkpoint key mapping matches that
    class's in-memory names to its checkpoints' keys, where transformers converts them in `from_pretrained`
    (MiniMax-M2: `block_sparse_moe.experts.{e}.w1/w3/w2` → stacked experts; Qwen3-MoE / Qwen3-Next:
    `mlp.experts.{e}.gate_proj/up_proj/down_proj` → stacked `gate_up_proj` / `down_proj`)."""
    spec = spec_for_model_type(getattr(hf_config, "model_type", None))
    return spec if spec is not None and spec.native_checkpoint_layout else None


def create_model(model_args: ModelArguments, hf_config, *, seed: int, device: torch.device,
                 parallelize: Parallelize, new_rows: Optional[Callable] = None) -> nn.Module:
    """The parallelised model with its weights: loaded from the HF directory, or seeded-initialised.

    `hf_config.vocab_size` may exceed the checkpoint's (a resized vocabulary): the extra rows come from
    `new_rows(old_full, n_new)`.
    """
    load = weights_available(model_args)
    spec = model_spec(model_args.model_id) if model_args.model_id else None
    if model_args.model_name_or_path and not model_args.train_from_scratch and not load and \
            not model_args.architecture:
        raise UsageError(f"model.model_name_or_path (--load): {model_args.model_name_or_path} holds no "
                         f"*.safetensors weights — convert the checkpoint to safetensors, or set train_from_scratch")
    if model_args.init_model_with_meta_device:
        model = parallelize(honour_time_step_limit(build_model(model_args, hf_config, on_meta=True)))
        model.to_empty(device=device)
        if load:
            load_safetensors(model, model_args.model_name_or_path, new_rows, spec, hf_config)
        seeded_initialize(model, seed, buffers_only=load)
        return model
    if load and not model_args.model_id and _checkpoint_vocab(model_args) == hf_config.vocab_size:
        from transformers import AutoModelForCausalLM

        from fsdp2_backend.config.weight_files import shape_mismatches

        # shapes against the config before transformers reports a mismatch as a table and a traceback
        expected = {n: tuple(p.shape) for n, p in build_model(model_args, hf_config, on_meta=True).named_parameters()}
        problems = shape_mismatches(expected, model_args.model_name_or_path)
        if problems:
            raise UsageError(problems)
        from transformers.utils import logging as hf_logging

        other_rank = os.environ.get("RANK", "0") != "0"  # every rank loads: one "Loading weights" bar per job
        if other_rank:
            hf_logging.disable_progress_bar()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_args.model_name_or_path, config=hf_config, dtype=torch.float32,
                trust_remote_code=model_args.trust_remote_code, cache_dir=model_args.cache_dir,
                revision=model_args.model_revision,
                token=model_args.hf_hub_token)
        finally:
            if other_rank:
                hf_logging.enable_progress_bar()
    else:
        model = build_model(model_args, hf_config, on_meta=False)
        if load:
            load_safetensors(model, model_args.model_name_or_path, new_rows, spec, hf_config)
        else:
            seeded_initialize(model, seed)
    return parallelize(honour_time_step_limit(model).to(device))  # models/nemotron_h.py: why


def _checkpoint_vocab(model_args: ModelArguments) -> Optional[int]:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code,
                                      cache_dir=model_args.cache_dir, revision=model_args.model_revision,
                                      token=model_args.hf_hub_token).vocab_size
