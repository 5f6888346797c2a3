"""Reads a Megatron-LM run's checkpoint for continuing it (``--load MEGATRON_DIR``) into plain state: the model
and the Adam moments and step (full tensors in HF names), the learning-rate schedule, the iteration and consumed
samples, the fp16 loss scale and the RNG (`read_megatron_state` → `MegatronState`). Nothing here touches the run:
``fsdp2_backend/training/megatron_continuation.py`` applies the state (the build hands it this reader).

What maps onto what (megatron-core 0.16.1 ``dist_checkpointing`` / ``optimizer``, Megatron-LM
``megatron/training/checkpointing.py``):

- The model is built from the HF config the checkpoint's saved ``args`` describe (``megatron_checkpoint``); the
  architecture flags given on the command line must agree with it (one line per disagreement) and the other model
  fields (dropouts, attention implementation) come from the flags. Weights are converted to the HF layout.
- Adam state. ``torch_dist``: ``optimizer.state.{exp_avg,exp_avg_sq}.KEY`` are global tensors in the model
  tensor's own layout (non-distributed optimizer, and ``--use-distributed-optimizer`` saved ``fully_reshardable``
  / ``fully_sharded_model_space``), so the weights' conversion converts them too (the qkv / fc1 splits are row
  permutations). With them, ``optimizer.state.{param,fp32_param}.KEY`` (the fp32 main weights of a bf16/fp16 run)
  are loaded as the weights; they must equal the model weights cast (megatron-core's ``fully_reshardable`` save of
  several padded buckets shifts them and the moments: declined). The step is one counter shared by all parameters
  (``common_step`` or the param groups' ``step`` in ``common.pt``). The distributed optimizer's default
  ``dp_reshardable`` format stores flat per-bucket buffers (and the step as a ShardedObject): ``megatron_distopt``
  maps them back to per-parameter tensors in the same keys (dense, MoE at EP 1, MLA, MTP; one TP/PP domain; others
  declined there, one line). Legacy
  ``torch``: ``model_optim_rng.pt['optimizer']`` is the torch optimizer's state dict; its parameter indices are
  matched to names by Megatron's param-group rule (groups by ``wd_mult``; 1-D and ``.bias`` parameters take no
  weight decay; parameters in model order), each shape checked; legacy ``distrib_optim.pt`` is declined.
  ``torch_dcp`` holds the legacy dict in DCP files (`dcp_format`): read as one legacy rank. Megatron-FSDP's
  ``fsdp_dtensor`` (DCP files too) keeps its Adam state per parameter name, read by `fsdp_dtensor`.
  Everything is then set through torch's ``set_state_dict`` with full tensors, so any FSDP / TP layout loads it.
- ``opt_param_scheduler`` loads into our ``ParamScheduler`` (same keys, counted in samples), with Megatron's
  ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler`` semantics
  (``training.lr_scheduler_on_resume``).
- ``iteration``, ``args.consumed_train_samples`` / ``consumed_valid_samples``: the data continues at the next
  sample Megatron would read (the GPTDataset and sampler are megatron-core's).
- fp16's ``grad_scaler`` (scale, growth and hysteresis trackers) maps onto our dynamic loss scaler.
- RNG: Python's ``random``, numpy's and torch's CPU generator, and the CUDA generator when this run is on CUDA,
  from the checkpoint's first RNG entry (the rank's own with ``--data-parallel-random-init``). Megatron's
  model-parallel RNG tracker states (dropout inside TP regions) have no counterpart here and are not restored;
  dropout masks differ anyway (different kernels draw them).

``--finetune``: weights only, iteration 0. ``--no-load-optim``: no Adam state, scheduler or loss scale (the
iteration and consumed samples still load, as in Megatron). ``--no-load-rng``: no RNG. Not mapped, each declined
with one line: pipeline-split and expert-parallel legacy checkpoints, per-parameter Adam steps, what the
conversion declines. MoE checkpoints (router, experts local or grouped, shared expert, dense layers) map weights and
moments through the same conversion (`megatron_checkpoint_moe`) onto the Qwen3-MoE / Qwen2-MoE / Mixtral model their
args describe; MLA checkpoints onto DeepSeek-V3 (`checkpoint/mla.py`), their MTP layers onto this project's
``mtp.layers.*`` (the run gives --mtp-num-layers, as its Megatron-LM script did) and the router's ``expert_bias``
buffer onto ``e_score_correction_bias`` (a buffer: no Adam state, and no member of a legacy optimizer's groups).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_compat.checkpoint import convert as mc
from megatron_compat.checkpoint.layout import checkpoint_format
from megatron_compat.checkpoint.dcp_format import (model_shapes, read_dcp_checkpoint, read_dcp_common,
                                                   read_flat_entries)
from megatron_compat.checkpoint.fsdp_dtensor import is_fsdp_dtensor, optimizer_state as fsdp_optimizer_state
from megatron_compat.checkpoint.safe_pickle import dcp_metadata, load_torch_file
from fsdp2_backend.distributed.console import print_rank0
from fsdp2_backend.usage_errors import UsageError

_OPTIM_RE = re.compile(r"^optimizer\.(?:chained_\d+\.)?state\.(exp_avg|exp_avg_sq|param|fp32_param)\.(.+)$")
_UNMAPPED_SHARDING = ("dp_zero_gather_scatter", "fully_sharded_bucket_space", "fsdp_dtensor")


# ------------------------------------------------------------------------------------------------ reading
def _tensor_shapes(it_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint as meta tensors (shapes only), for the HF config."""
    if checkpoint_format(it_dir) == "torch_dist":
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        meta = dcp_metadata(it_dir).state_dict_metadata
        return {k: torch.empty(m.size, dtype=m.properties.dtype, device="meta") for k, m in meta.items()
                if isinstance(m, TensorStorageMetadata) and not k.startswith(("optimizer.", "rng_state"))}
    if checkpoint_format(it_dir) == "torch_dcp":
        return mc._merge_tensor_parallel([model_shapes(it_dir)])
    shards = [{k: v.to("meta") for k, v in saved["model"].items()
               if isinstance(v, torch.Tensor) and "_extra_state" not in k} for saved in _legacy_files(it_dir)]
    return mc._merge_tensor_parallel(shards)


def _legacy_files(it_dir: Path, mmap: bool = True) -> list[dict]:
    """Every tensor-parallel rank's model_optim_rng.pt of a legacy checkpoint, in rank order."""
    groups = mc.legacy_rank_groups(it_dir)  # declines pipeline splits
    if len(groups) > 1:
        raise UsageError(f"{it_dir}: a legacy Megatron-LM checkpoint split over {len(groups)} expert-parallel ranks "
                         f"— resuming it is not mapped; convert it with tools/convert_checkpoint.py and --load the "
                         f"HF directory (weights only), or re-save it with Megatron-LM's --ckpt-format torch_dist")
    ranks = groups[0]
    out = []
    for rank in ranks:
        path = rank / "model_optim_rng.pt"
        if not path.is_file():
            raise UsageError(f"{rank}: no model_optim_rng.pt in this Megatron-LM checkpoint directory")
        out.append(load_torch_file(path, mmap=mmap))
        if "model" not in out[-1]:
            raise UsageError(f"{path}: holds no 'model' (a virtual-pipeline checkpoint) — re-save it with "
                             f"Megatron-LM's --ckpt-format torch_dist")
    return out


def _common(it_dir: Path) -> dict:
    """The non-tensor part: common.pt (torch_dist) or rank 0's model_optim_rng.pt without its tensors."""
    if checkpoint_format(it_dir) == "torch_dist":
        return mc._load_pickled(it_dir / "common.pt")
    if checkpoint_format(it_dir) == "torch_dcp":
        return read_dcp_common(it_dir)
    return _legacy_files(it_dir)[0]


@functools.lru_cache(maxsize=4)
def megatron_architecture(it_dir: str) -> tuple:
    """(HF config dict of the checkpoint's model, the saved args) — cached: validation and the build both ask."""
    it_dir = Path(it_dir)
    args = _common(it_dir).get("args")
    config = mc.hf_config_from_args(args, _tensor_shapes(it_dir))
    fields = config.to_diff_dict()
    fields.pop("transformers_version", None)
    return fields, args


def megatron_model_args(model_args, it_dir: Path):
    """The run's ModelArguments for a Megatron-LM checkpoint: the model from the checkpoint's args; the remaining
    model fields (dropouts, ...) from the flags. Architecture flags that disagree with the checkpoint were reported
    by validation (one line each, Megatron's words: `config.validation`, the checkpoint's facts via model_facts)."""
    from megatron_compat.checkpoint.tokenizer_assets import TOKENIZER_DIR, checkpoint_tokenizer

    fields, args = megatron_architecture(str(it_dir))
    given = {k: v for k, v in (model_args.architecture or {}).items() if v is not None}
    tokenizer = {}
    if not (model_args.tokenizer_type or model_args.tokenizer_name_or_path):  # the one the checkpoint carries
        tokenizer = checkpoint_tokenizer(Path(it_dir), args)
        if tokenizer is None:
            raise UsageError(f"--tokenizer-type / --tokenizer-model: the Megatron-LM checkpoint {it_dir} carries no "
                             f"tokenizer this run can read (no {TOKENIZER_DIR}/ for its saved tokenizer type "
                             f"{getattr(args, 'tokenizer_type', None)!r}) — give the run's tokenizer flags")
        print_rank0(f"  tokenizer: {tokenizer['tokenizer_type']} from the Megatron-LM checkpoint {it_dir}")
    return dataclasses.replace(model_args, model_name_or_path=None, train_from_scratch=True,
                               architecture={**given, **fields}, **tokenizer)


def _config_of(fields: dict):
    from transformers import AutoConfig

    fields = dict(fields)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# ------------------------------------------------------------------------------------------- the optimizer
def _find(obj: Any, key: str) -> list:
    """Every value stored under ``key`` anywhere in nested dicts / lists (common.pt's optimizer part)."""
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += [v] if k == key else _find(v, key)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found += _find(v, key)
    return found


def _common_step(optim_common: Any, where: Path) -> int:
    steps = {int(s) for s in _find(optim_common, "common_step") + _find(optim_common, "step")
             if isinstance(s, (int, float, torch.Tensor)) and not isinstance(s, bool)}
    if len(steps) != 1:
        raise UsageError(f"{where}: the optimizer's step is {sorted(steps) or 'missing'} — one Adam step shared by "
                         f"all parameters is needed; resume with --no-load-optim")
    return steps.pop()


def _torch_dist_optimizer(it_dir: Path, common: dict, weights: dict) -> tuple[dict, int]:
    """({exp_avg / exp_avg_sq / param: {megatron key: tensor}}, step) of a torch_dist checkpoint."""
    sharding = _find(common.get("optimizer"), "param_state_sharding_type")
    if any(s in _UNMAPPED_SHARDING for s in sharding):
        raise UsageError(f"{it_dir}: the distributed optimizer's state is saved as {sharding[0]} (flat per-bucket "
                         f"buffers in Megatron's grad-buffer layout) — re-save it with Megatron-LM's "
                         f"--dist-ckpt-optim-fully-reshardable, or resume with --no-load-optim")
    if "dp_reshardable" in sharding:  # flat per-bucket buffers, mapped back to the parameters (megatron_distopt)
        from megatron_compat.checkpoint.distopt import read_dp_reshardable

        out, objects = read_dp_reshardable(it_dir, weights)
        common["optimizer"].update(objects)  # the step and the grad scaler are ShardedObjects in this format
        return out, _common_step(common["optimizer"], it_dir)
    tensors = read_flat_entries(it_dir, lambda k: bool(_OPTIM_RE.match(k)))
    out: dict[str, dict] = {"exp_avg": {}, "exp_avg_sq": {}, "param": {}}
    for key, value in tensors.items():
        kind, name = _OPTIM_RE.match(key).groups()
        out["param" if kind == "fp32_param" else kind][name] = value
    if not out["exp_avg"]:
        raise UsageError(f"{it_dir}: holds no Adam moments (optimizer.state.exp_avg.*) — resume with --no-load-optim")
    # The model weights are the main weights cast to the model's dtype. megatron-core 0.16.1's fully_reshardable save
    # of a distributed optimizer with padded buckets (several buckets: --overlap-grad-reduce) slices the state at
    # offsets shifted by the inter-bucket padding (its warning "param range exceeds unpadded buffer", issue #504).
    shifted = sorted(k for k, v in out["param"].items() if k in weights and not torch.equal(v.to(weights[k].dtype),
                                                                                            weights[k]))
    if shifted:
        raise UsageError(f"{it_dir}: the optimizer's per-parameter state does not line up with the model weights "
                         f"({shifted[0]}, ...: megatron-core's fully_reshardable save of multi-bucket distributed-"
                         f"optimizer state shifts it, its issue #504) — re-save with Megatron-LM's default "
                         f"dp_reshardable format, or resume with --no-load-optim")
    return out, _common_step(common.get("optimizer"), it_dir)


def _legacy_optimizer(it_dir: Path, files: list[dict]) -> tuple[dict, int]:
    """The same from a legacy checkpoint: per rank, torch's optimizer state dict indexed by Megatron's param
    groups, named here, then merged over tensor-parallel ranks like the weights."""
    if any((r / "distrib_optim.pt").is_file() for r in it_dir.iterdir() if r.is_dir()):
        raise UsageError(f"{it_dir}: the distributed optimizer's legacy distrib_optim.pt (flat grad-buffer layout) "
                         f"is not mapped — re-save with --ckpt-format torch_dist --dist-ckpt-optim-fully-reshardable, "
                         f"or resume with --no-load-optim")
    per_rank: dict[str, list] = {"exp_avg": [], "exp_avg_sq": [], "param": []}
    steps = set()
    for saved in files:
        optim = saved.get("optimizer")
        if optim is None:
            raise UsageError(f"{it_dir}: saved without an optimizer (--no-save-optim) — resume with --no-load-optim")
        inner = optim.get("optimizer", optim)
        names = _legacy_param_names(saved["model"], inner["param_groups"], it_dir)
        state = inner["state"]
        fp32 = [t for group in optim.get("fp32_from_fp16_params") or [] for t in group]
        shapes = {k: v.shape for k, v in saved["model"].items() if isinstance(v, torch.Tensor)}
        for index, name in names.items():
            if index not in state or state[index]["exp_avg"].shape != shapes[name]:
                raise UsageError(f"{it_dir}: the optimizer state of parameter {index} does not fit {name} — resume "
                                 f"with --no-load-optim")
        for kind in ("exp_avg", "exp_avg_sq"):
            per_rank[kind].append({name: state[index][kind] for index, name in names.items()})
        if fp32:
            per_rank["param"].append({name: fp32[i] for i, name in enumerate(names.values())})
        steps |= {int(s["step"]) for s in state.values() if "step" in s}
        steps |= {int(s) for s in _find(inner.get("param_groups"), "step")}
    if len(steps) != 1:
        raise UsageError(f"{it_dir}: the optimizer's step is {sorted(steps) or 'missing'} — resume with "
                         f"--no-load-optim")
    out = {kind: mc._merge_tensor_parallel(shards) if shards else {} for kind, shards in per_rank.items()}
    return out, steps.pop()


def _legacy_param_names(model: dict, groups: list[dict], where: Path) -> dict[int, str]:
    """{optimizer index: parameter name}: Megatron's groups hold the parameters in model order, those without
    weight decay (1-D, or ``.bias``) in the groups whose ``wd_mult`` is 0."""
    # the router's expert bias (--moe-router-enable-expert-bias) is a buffer in the state dict, not a parameter
    params = [(k, v) for k, v in model.items() if isinstance(v, torch.Tensor) and "_extra_state" not in k
              and not k.endswith("router.expert_bias")]
    names: dict[int, str] = {}
    for group in groups:
        no_wd = float(group.get("wd_mult", 1.0)) == 0.0
        decoupled = bool(group.get("is_decoupled_lr", False))
        if decoupled:
            raise UsageError(f"{where}: the optimizer has a decoupled-lr param group — its legacy state is not "
                             f"mapped; re-save with --ckpt-format torch_dist, or resume with --no-load-optim")
        members = [k for k, v in params if (k.endswith(".bias") or v.dim() == 1) == no_wd]
        if len(members) != len(group["params"]):
            raise UsageError(f"{where}: an optimizer param group holds {len(group['params'])} parameters, Megatron's "
                             f"grouping rule gives {len(members)} — resume with --no-load-optim")
        names.update(zip(group["params"], members))
    return names


# -------------------------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class MegatronState:
    """What a Megatron-LM checkpoint holds, in this project's terms: full tensors in the HF names of ``config``;
    ``moments`` ({exp_avg / exp_avg_sq: {HF name: tensor}}), ``step``, ``scheduler`` (opt_param_scheduler's state)
    and ``grad_scaler`` (our loss scaler's keys) None unless the optimizer state is read; ``rng`` this rank's
    generator states, None when not read. Applied by fsdp2_backend/training/megatron_continuation.py."""

    where: Path
    fmt: str
    config: Any
    weights: dict
    moments: Optional[dict]
    step: Optional[int]
    scheduler: Optional[dict]
    grad_scaler: Optional[dict]
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    rng: Optional[dict]
    finetune: bool


def read_megatron_state(it_dir: Path, *, load_optim: bool = True, load_rng: bool = True, finetune: bool = False,
                        rank: int = 0) -> MegatronState:
    """Reads what maps from the Megatron-LM checkpoint ``it_dir`` (every rank reads it whole; ``rank`` picks the RNG
    entry under --data-parallel-random-init). --finetune: weights only, iteration 0."""
    it_dir = Path(it_dir)
    fmt = checkpoint_format(it_dir)
    fields, args = megatron_architecture(str(it_dir))
    config = _config_of(fields)
    print_rank0(f" loading Megatron-LM {fmt} checkpoint from {it_dir.parent} at iteration {it_dir.name}")
    if fmt == "torch_dist":
        common = mc._load_pickled(it_dir / "common.pt")
        weights = read_flat_entries(it_dir, lambda k: not k.startswith(("optimizer.", "rng_state", "rerun_state"))
                                      and "_extra_state" not in k)
        files = None
    else:  # legacy, or torch_dcp: the legacy format's dict in DCP files (one "rank")
        files = [read_dcp_checkpoint(it_dir)] if fmt == "torch_dcp" else _legacy_files(it_dir, mmap=False)
        common = files[0]
        weights = mc._merge_tensor_parallel([{k: v for k, v in f["model"].items() if isinstance(v, torch.Tensor)
                                              and "_extra_state" not in k} for f in files])
    load_optim = load_optim and not finetune
    moments, step, scheduler, grad_scaler = None, None, None, None
    if load_optim:
        if fmt == "torch_dist":
            moments, step = _torch_dist_optimizer(it_dir, common, weights)
        elif fmt == "torch_dcp" and is_fsdp_dtensor(args):  # Megatron-FSDP: state per parameter name
            moments, step = fsdp_optimizer_state(common.get("optimizer"), it_dir)
        else:
            moments, step = _legacy_optimizer(it_dir, files)
        if moments["param"]:  # the fp32 main weights of a mixed-precision run: the exact ones
            weights = {**weights, **moments["param"]}
        moments = {kind: mc.to_hf_state_dict(moments[kind], config) for kind in ("exp_avg", "exp_avg_sq")}
        scheduler = common.get("opt_param_scheduler", common.get("lr_scheduler"))
        scaler = (_find(common.get("optimizer"), "grad_scaler") or [None])[0]
        if isinstance(scaler, dict):
            grad_scaler = {"scale": float(scaler["scale"]), "good_steps": int(scaler["growth_tracker"]),
                           "hysteresis_left": int(scaler["hysteresis_tracker"])}
    return MegatronState(
        where=it_dir, fmt=fmt, config=config, weights=mc.to_hf_state_dict(weights, config), moments=moments,
        step=step, scheduler=scheduler, grad_scaler=grad_scaler,
        iteration=0 if finetune else int(common.get("iteration", 0) or 0),
        consumed_train_samples=0 if finetune else int(getattr(args, "consumed_train_samples", 0) or 0),
        consumed_valid_samples=0 if finetune else int(getattr(args, "consumed_valid_samples", 0) or 0),
        rng=_rng_entry(it_dir, common, fmt, args, rank) if load_rng and not finetune else None, finetune=finetune)


def _rng_entry(it_dir: Path, common: dict, fmt: str, args: Any, rank: int) -> Optional[dict]:
    """This rank's RNG states (the first entry, or the rank's own with --data-parallel-random-init)."""
    entries = common.get("rng_state")
    if fmt == "torch_dist":
        found = read_flat_entries(it_dir, lambda k: k.startswith("rng_state"))
        if found:  # one ShardedObject per (pp, tp) rank: the first tensor-parallel rank's (DCP unpickles it)
            entries = found[sorted(found)[0]]
    while isinstance(entries, (list, tuple)) and len(entries) == 1 and isinstance(entries[0], (list, tuple)):
        entries = entries[0]  # a ShardedObject read back as the list of its one shard
    if not entries:
        print_rank0(f"  {it_dir}: no RNG state in the checkpoint — the seeded generators are kept")
        return None
    return entries[rank] if getattr(args, "data_parallel_random_init", False) and rank < len(entries) else entries[0]
