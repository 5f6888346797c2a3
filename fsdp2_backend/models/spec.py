"""`ModelSpec`: everything the engine and its validation know about one model id, declared in one place.

Each id's spec lives in `fsdp2_backend/models/<id>/spec.py` (`SPEC`), listed once in `models/registry.py`. A spec
DECLARES what the id supports — the HF model types it builds, its other names, the parallel layouts it takes
(tensor parallel, the context-parallel kinds and layer types, expert parallel), its MTP layout, its router, packed
documents — and the reasons a layout is declined (`notes`). Config validation, the parallel stages, the model
loader and the Megatron front end read these facts; no other module lists ids or branches on one.

The implementation is named, not imported: `lazy("qwen3_moe.modeling:build_qwen3_moe")` imports
`fsdp2_backend.models.qwen3_moe.modeling` at the first call. So this module, the registry and every spec import no
torch and no model code (config validation reads them; tests/tools/test_import_layers.py checks it).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable, FrozenSet, Mapping, Optional, Tuple

CP_KINDS = ("ulysses", "ring", "kvallgather")  # parallel.cp_type's values
ROUTERS = ("none", "megatron", "own")


def lazy(reference: str, *, drop_last: bool = False) -> Callable:
    """The function `reference` ("module:function", the module under `fsdp2_backend.models`, or a full dotted
    path), imported at its first call. `drop_last`: called without the trailing argument the engine passes (the
    hf_config of checkpoint hooks, the device type of configure hooks) for functions that take none."""
    module, name = reference.split(":")
    path = module if module.startswith("fsdp2_backend.") else f"fsdp2_backend.models.{module}"

    def call(*args):
        function = getattr(importlib.import_module(path), name)
        return function(*(args[:-1] if drop_last else args))
    call.reference = reference
    return call


def resolve(reference: str):
    """The object `reference` ("module:name", as `lazy`) names, imported now (the caller is model code)."""
    module, name = reference.split(":")
    path = module if module.startswith("fsdp2_backend.") else f"fsdp2_backend.models.{module}"
    return getattr(importlib.import_module(path), name)


@dataclass(frozen=True)
class ModelSpec:
    """One model id: what it supports (read by validation and the stages) and how to build, load and configure it
    (lazy callables, see `lazy`)."""

    model_id: str
    hf_model_types: Tuple[str, ...]  # the HF config `model_type`s this id builds
    build: Callable  # (hf_config) -> nn.Module causal LM with HF's `_init_weights`
    name: str = ""  # the model's own name in messages (transformers' class family), e.g. "DeepSeek-V3"
    aliases: Mapping[str, str] = field(default_factory=dict)  # another name of the id → whose name it is
    # transformers builds no causal LM for its HF model types: a directory of that type needs this id
    needs_model_id: bool = False
    # --- parallel layouts
    tp: bool = True  # tensor parallel (notes["tp"] says why not)
    cp_kinds: Tuple[str, ...] = CP_KINDS  # the parallel.cp_type values its context parallel takes (notes["cp"])
    cp_layer_types: FrozenSet[str] = frozenset({"full_attention"})  # the layer types its context parallel handles
    cp_splits_heads: bool = True  # Ulysses splits heads (False: the keys are gathered, no head check)
    cp_packed_documents: bool = True  # packed documents under context parallel
    # its own context parallel ("module:function" of fsdp2_backend.parallel.context_parallel, enable(model, mesh,
    # cp_type)), and the notice said for cp_type kvallgather
    cp_hook: Optional[str] = None
    ep: bool = False  # experts, hence expert parallel
    # the declines hold for transformers' own model of these types too (model_id unset)
    declines_transformers_model: bool = False
    # --- MTP: "module:Class" of the layout its checkpoints keep MTP layers in (None: MTP not built for it)
    mtp_layout: Optional[str] = None
    mtp_depths: Optional[int] = None  # the only mtp_num_layers its layout holds (notes["mtp"])
    # --- router: "megatron" (this project's router takes Megatron's options), "own" (its own routers: Megatron's
    # options declined, notes["router"]), "none" (no experts)
    router: str = "none"
    router_promoted: bool = False  # transformers' model of its type runs as this id when EP / router options ask
    router_scores_sigmoid: bool = False  # scores with sigmoid by itself (an expert bias needs no score function)
    expert_bias: bool = True  # Megatron's expert-bias update (notes["expert_bias"])
    group_score_top2: bool = False  # transformers' group-limited routing scores a group by its top 2
    renormalises_topk: bool = False  # its sigmoid router always renormalises (norm_topk_prob false is declined)
    native_checkpoint_layout: bool = False  # transformers' class of its type keeps the checkpoint keys this id maps
    # --- MindSpeed's model-specific fields
    dsa: bool = False  # DeepSeek sparse attention (MindSpeed's DSA fusion switches)
    mindspeed_mhc: bool = False  # use_ascend_mhc / use_triton_swiglu_limit are its fields
    mindspeed_master_only: bool = False  # MindSpeed-LLM master's id, not v26.1.0's
    attention_free: bool = False  # no attention heads (an SSM)
    # the reasons a layout or option is declined, by what: "tp", "cp", "mtp", "router", "expert_bias", "kvallgather"
    # (the notice for cp_type kvallgather); `{model_id}`, `{which}` and `{cp_type}` are filled in
    notes: Mapping[str, str] = field(default_factory=dict)
    # --- implementation hooks
    checkpoint_keys: Optional[Callable] = None  # (name, hf_config) -> checkpoint keys holding the parameter
    from_checkpoint: Optional[Callable] = None  # (name, tensors, hf_config) -> the parameter
    configure: Optional[Callable] = None  # (model, config, device type): the run's switches
    register_hf: Optional[Callable] = None  # registers its own HF config class with transformers' Auto classes
    stored_layout: Optional[Callable] = None  # (name, tensor, hf_config): another stored layout → the model's

    def __post_init__(self):
        assert self.router in ROUTERS and set(self.cp_kinds) <= set(CP_KINDS), self

    def note(self, what: str, **values) -> str:
        """The reason `what` is declined, with the id and `values` filled in."""
        kinds = " or ".join(self.cp_kinds)
        default = {"tp": "parallel.tp_size: model_id {model_id} is not built for tensor parallel — use tp_size 1",
                   "cp": ("parallel.cp_type: {cp_type} is not built for model_id {model_id} — use " + kinds
                          + ", or cp_size 1") if kinds else
                         "parallel.cp_size: model_id {model_id} is not built for context parallel — use cp_size 1"}
        return self.notes.get(what, default.get(what, what)).format(model_id=self.model_id, **values)
