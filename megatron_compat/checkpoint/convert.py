"""Reads a Megatron-LM checkpoint (the ``torch_dist`` or the legacy ``torch`` format) and converts the weights of
a dense GPT to the Hugging Face Llama / Qwen2 / Qwen3 layout, with an HF config derived from the saved ``args``.

Layout facts (megatron-core 0.16.1 ``dist_checkpointing``, Megatron-LM ``megatron/training/checkpointing.py``):

- Which format a directory holds is told by its file names (`layout`).
- ``torch_dist``: ``metadata.json`` (``sharded_backend: torch_dist``), ``common.pt`` (everything that is not a
  sharded tensor: ``args``, ``iteration``, ...) and PyTorch DCP files (``.metadata``, ``*.distcp``). The layers'
  tensors are stacked under one key with a leading layer axis (``decoder.layers.mlp.linear_fc2.weight``:
  ``[num_layers, H, F]``), and the layer norms are saved under the Transformer Engine names
  (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``) whichever spec trained the model.
- ``torch_dcp``: DCP files only, the legacy format's dict flattened (`dcp_format`).
- legacy ``torch``: ``mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt``, a ``torch.save`` of a dict with ``args``,
  ``iteration`` and ``model`` (the module's ``state_dict``: one key per layer; under the local spec the norms are
  ``input_layernorm`` / ``pre_mlp_layernorm``).
- ``linear_qkv`` rows are grouped per query group: for each of the ``num_query_groups`` groups,
  ``heads/groups`` query heads, then one key head, then one value head (``head_dim`` rows each).
  ``linear_fc1`` of a gated MLP is ``[gate; up]``.

The DCP files are read with torch's own ``FileSystemReader`` (``no_dist``: no process group needed), every pickle
(``common.pt``, ``.metadata``, legacy files) through `safe_pickle`'s allow-list; only the layout conversion is
ours (the key mapping is `gpt_keys`), since no library converts Megatron's layout without Megatron-LM itself.
Scope: dense GPT models, and MoE GPT models (experts local or grouped, any expert-parallel split; routers, shared
experts and dense layers as transformers' Qwen3-MoE / Qwen2-MoE / Mixtral have them: `megatron_checkpoint_moe`),
and multi-latent-attention models with their MTP layers as transformers' DeepSeek-V3 (`checkpoint/mla.py`); MTP
layers of other models are declined with the reason. The legacy format is read at any tensor- and expert-parallel
size and one pipeline stage (``mp_rank_TT[_PPP][_EEE]``; pipeline splits are declined; torch_dist reads at any
split, its tensors being global).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_compat.checkpoint.dcp_format import read_dcp_checkpoint
from megatron_compat.checkpoint.layout import LATEST_FILE, LEGACY_RE, checkpoint_format, megatron_iteration_dir
from megatron_compat.checkpoint.safe_pickle import dcp_load, dcp_metadata, load_torch_file
from megatron_compat.checkpoint.gpt_keys import to_hf_state_dict
from megatron_compat.checkpoint.mla import attach_mtp_layers, is_mla, mla_config
from megatron_compat.checkpoint.moe import is_moe, moe_config, normalize_experts
from fsdp2_backend.usage_errors import UsageError


def read_megatron_checkpoint(path: os.PathLike | str) -> tuple[dict[str, torch.Tensor], Any, int]:
    """(model state dict in Megatron's names, the saved args namespace or None, iteration) of the checkpoint
    ``path`` names. torch_dist tensors keep their stacked layer axis; legacy ones are per layer."""
    it_dir = megatron_iteration_dir(path)
    if it_dir is None:
        raise UsageError(f"{path}: no Megatron-LM checkpoint there (no {LATEST_FILE}, iter_* directory with "
                         f"DCP files (.metadata), or mp_rank_* directory)")
    if checkpoint_format(it_dir) == "torch_dist":
        return _read_torch_dist(it_dir)
    if checkpoint_format(it_dir) == "torch_dcp":
        saved = read_dcp_checkpoint(it_dir, with_optimizer=False)
        return normalize_experts(saved["model"]), saved.get("args"), int(saved.get("iteration", 0) or 0)
    return _read_legacy(it_dir)


def _load_pickled(path: Path) -> Any:
    """A foreign torch.save file (common.pt, model_optim_rng.pt) through the allow-list (`safe_pickle`)."""
    return load_torch_file(path)


def _read_torch_dist(it_dir: Path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    common = _load_pickled(it_dir / "common.pt")
    state = {}
    for key, meta in dcp_metadata(it_dir).state_dict_metadata.items():
        # Model tensors only: optimizer moments ("optimizer.*"), RNG and rerun state are not weights.
        if isinstance(meta, TensorStorageMetadata) and not key.startswith(("optimizer.", "rng_state",
                                                                            "rerun_state")):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp_load(state, it_dir)
    return state, common.get("args"), int(common.get("iteration", 0) or 0)


def legacy_rank_groups(it_dir: Path) -> dict[int, list[Path]]:
    """{expert-parallel rank: its tensor-parallel rank directories, in order} of a legacy checkpoint. Megatron-LM's
    ``get_checkpoint_name`` names them ``mp_rank_TT``, ``_PPP`` added with pipeline parallelism, ``_EEE`` with expert
    parallelism: a two-number name is told apart by the saved args (``pipeline_model_parallel_size``)."""
    dirs = sorted(c for c in it_dir.iterdir() if c.is_dir() and LEGACY_RE.match(c.name))
    parts = [LEGACY_RE.match(d.name).groups() for d in dirs]
    if any(p[1] is not None and p[2] is None for p in parts):
        files = [dirs[0] / n for n in ("model_optim_rng.pt", "model_rng.pt") if (dirs[0] / n).is_file()]
        args = _load_pickled(files[0]).get("args") if files else None
        pipeline = int(_arg(args, "pipeline_model_parallel_size", 1)) > 1 or not int(
            _arg(args, "expert_model_parallel_size", 1)) > 1
        parts = [(t, p, None) if pipeline else (t, None, p) for t, p, _ in parts]
    if any(p[1] not in (None, "000") for p in parts):
        raise UsageError(f"{it_dir}: a legacy Megatron-LM checkpoint split over pipeline stages ({dirs[-1].name}) — "
                         f"only tensor- and expert-parallel legacy splits are read; re-save it with Megatron-LM's "
                         f"--ckpt-format torch_dist (or --ckpt-convert-format torch_dist)")
    groups: dict[int, list[Path]] = {}
    for d, (tp, _, ep) in sorted(zip(dirs, parts), key=lambda x: (int(x[1][2] or 0), int(x[1][0]))):
        groups.setdefault(int(ep or 0), []).append(d)
    return groups


def _read_legacy(it_dir: Path):
    groups = legacy_rank_groups(it_dir)
    merged: dict[str, torch.Tensor] = {}
    args, iteration = None, 0
    for ep_rank, rank_dirs in groups.items():
        shards, args, iteration = _read_legacy_ranks(rank_dirs)
        if is_moe(args, shards[0]) and len(shards) > 1 and int(_arg(args, "expert_tensor_parallel_size",
                                                                     len(shards))) != len(shards):
            raise UsageError(f"{it_dir}: a legacy MoE checkpoint whose experts are split over "
                             f"--expert-tensor-parallel-size {_arg(args, 'expert_tensor_parallel_size')} ranks, the "
                             f"rest over {len(shards)} — not read; re-save it with --ckpt-format torch_dist")
        merged.update(_merge_tensor_parallel(shards, ep_rank, len(groups)))  # shared weights: the same on each
    return merged, args, iteration


def _read_legacy_ranks(rank_dirs: list[Path]):
    shards, args, iteration = [], None, 0
    for rank_dir in rank_dirs:
        files = [rank_dir / n for n in ("model_optim_rng.pt", "model_rng.pt") if (rank_dir / n).is_file()]
        if not files:
            raise UsageError(f"{rank_dir}: no model_optim_rng.pt in this Megatron-LM checkpoint directory")
        saved = _load_pickled(files[0])
        if "model" not in saved:
            raise UsageError(f"{files[0]}: holds no 'model' (a virtual-pipeline checkpoint with model0, model1, "
                             f"... is not read) — re-save it with Megatron-LM's --ckpt-format torch_dist")
        shards.append({k: v for k, v in saved["model"].items()
                       if isinstance(v, torch.Tensor) and "_extra_state" not in k})
        args, iteration = saved.get("args"), int(saved.get("iteration", 0) or 0)
    return shards, args, iteration


def _merge_tensor_parallel(shards: list[dict[str, torch.Tensor]], ep_rank: int = 0,
                           ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One state dict from the per-rank ones of a tensor-parallel legacy save. Column-parallel weights (rows
    split: embedding, output layer, linear_qkv — each rank holds whole query groups — and linear_fc1) join on
    dim 0, row-parallel ones (linear_proj, linear_fc2) on dim 1; norms and row-parallel biases are replicated.
    A gated linear_fc1 shard is [gate_r; up_r]: the gates and the ups join separately. Experts are first put in
    one per-expert form with global indices (``ep_rank`` of ``ep_size``: `megatron_checkpoint_moe`), whose
    linear_fc1 / linear_fc2 then join as the dense ones."""
    shards = [normalize_experts(shard, ep_rank, ep_size) for shard in shards]
    if len(shards) == 1:
        return shards[0]
    if any(k.endswith("self_attention.linear_kv_down_proj.weight") for k in shards[0]):
        # the latent down-projections are replicated under Transformer Engine's spec, split under the local one
        raise UsageError(f"a legacy multi-latent-attention checkpoint split over {len(shards)} tensor-parallel ranks "
                         f"— its latent projections' split depends on the layer spec, which the files do not say; "
                         f"re-save it with Megatron-LM's --ckpt-format torch_dist (global tensors)")
    merged = {}
    for key, first in shards[0].items():
        parts = [shard[key] for shard in shards]
        if key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            halves = [p.chunk(2, dim=0) for p in parts]
            merged[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        elif key.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                           "linear_qkv.bias")):
            merged[key] = torch.cat(parts, dim=0)
        elif key.endswith(("linear_proj.weight", "linear_fc2.weight")):
            merged[key] = torch.cat(parts, dim=1)
        else:
            merged[key] = first
    return merged


def _arg(args: Any, name: str, default=None):
    value = getattr(args, name, None) if args is not None else None
    return default if value is None else value


# Saved args that change the model's function and that the HF layouts here cannot express: (argparse dest, flag,
# what it does). A value other than the default declines the conversion, never silently dropped.
_UNMAPPED_ARGS = (
    ("layernorm_zero_centered_gamma", "--apply-layernorm-1p", "norm weights stored as w - 1"),
    ("rotary_interleaved", "--rotary-interleaved", "interleaved rotary pairs"),
    ("rotary_seq_len_interpolation_factor", "--rotary-seq-len-interpolation-factor", "rotary position scaling"),
    ("qk_l2_norm", "--qk-l2-norm", "L2-normalised queries and keys"),
    ("attention_output_gate", "--attention-output-gate", "a gated attention output"),
    ("window_size", "--window-size", "sliding-window attention"),
    ("glu_linear_offset", "--glu-linear-offset", "an offset in the gated MLP"),
    ("activation_func_clamp_value", "--activation-func-clamp-value", "a clamped activation"),
    ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm",
     "residuals taken after the norm"),
    ("softmax_type", "--softmax-type", "a non-standard attention softmax"),
    ("no_rope_freq", "--no-rope-freq", "layers without rotary embeddings"),
    ("experimental_attention_variant", "--experimental-attention-variant", "another attention kind"),
    ("use_mup", "--use-mup", "muP scaling of embeddings and logits"),
    ("heterogeneous_layers_config_path", "--heterogeneous-layers-config-path", "layers of different shapes"),
    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor", "token dropping in the experts"),
    ("moe_latent_size", "--moe-latent-size", "experts in a latent space"),
)


def hf_config_from_args(args: Any, state: dict[str, torch.Tensor]):
    """An HF config for the model Megatron's saved ``args`` describe: DeepSeek-V3 with ``--multi-latent-attention``
    (`checkpoint/mla.py`), Qwen3 with ``--qk-layernorm``, Qwen2 with ``--add-qkv-bias``, else Llama (their MoE kinds
    with ``--num-experts``). Shapes the args do not carry are read from the tensors."""
    from transformers import AutoConfig

    if args is None:
        raise UsageError("the Megatron-LM checkpoint carries no 'args' — give the model's HF config directory "
                         "(tools/convert_checkpoint.py --hf-config DIR)")
    if _arg(args, "mtp_num_layers") and not is_mla(args):
        raise UsageError("the Megatron-LM checkpoint has multi-token prediction layers (--mtp-num-layers) — the "
                         "Llama / Qwen HF layouts hold none (only DeepSeek-V3-style MLA checkpoints convert with "
                         "them); not converted")
    for dest, flag, why in _UNMAPPED_ARGS:  # saved under Megatron-LM's argparse dests (its arguments.py)
        value = getattr(args, dest, None)
        if value not in (None, False, 0, 0.0, "vanilla") and value != []:
            raise UsageError(f"the Megatron-LM checkpoint was trained with {flag} {value!r} ({why}) — the Llama / "
                             f"Qwen HF layouts have no counterpart; not converted")
    if not _arg(args, "swiglu", False):
        raise UsageError("the Megatron-LM checkpoint's MLP is not gated (no --swiglu) — only Llama/Qwen-style "
                         "(SwiGLU, RMSNorm, RoPE) GPT checkpoints convert to an HF model")
    if _arg(args, "normalization", "LayerNorm") != "RMSNorm" or _arg(args, "position_embedding_type",
                                                                     "learned_absolute") != "rope":
        raise UsageError("the Megatron-LM checkpoint is not RMSNorm + RoPE (--normalization / "
                         "--position-embedding-type) — only Llama/Qwen-style GPT checkpoints convert")
    if _arg(args, "add_bias_linear", True) and any(k.endswith("linear_fc2.bias") for k in state):
        raise UsageError("the Megatron-LM checkpoint has biases on its linear layers (no --disable-bias-linear) "
                         "— the Llama/Qwen HF layouts have none there")
    heads = int(args.num_attention_heads)
    hidden = int(args.hidden_size)
    groups = int(_arg(args, "num_query_groups", heads)) if _arg(args, "group_query_attention", False) else heads
    head_dim = int(_arg(args, "kv_channels", hidden // heads))
    qkv_bias = any(k.endswith("linear_qkv.bias") for k in state)
    model_type = "qwen3" if _arg(args, "qk_layernorm", False) else ("qwen2" if qkv_bias else "llama")
    fields = dict(
        vocab_size=int(state["embedding.word_embeddings.weight"].shape[0]),  # the padded vocabulary, as trained
        hidden_size=hidden, intermediate_size=int(_arg(args, "ffn_hidden_size", 4 * hidden)),
        num_hidden_layers=int(args.num_layers), num_attention_heads=heads, num_key_value_heads=groups,
        head_dim=head_dim, rms_norm_eps=float(_arg(args, "layernorm_epsilon", 1e-5)),  # --norm-epsilon's dest
        rope_theta=float(_arg(args, "rotary_base", 10000)), hidden_act="silu",
        max_position_embeddings=int(_arg(args, "max_position_embeddings", _arg(args, "seq_length", 4096))),
        tie_word_embeddings=not _arg(args, "untie_embeddings_and_output_weights", False))
    if _arg(args, "rotary_percent", 1.0) != 1.0 or _arg(args, "use_rope_scaling", False):
        raise UsageError("the Megatron-LM checkpoint uses --rotary-percent < 1 or --use-rope-scaling — not "
                         "converted yet (the HF config would compute different rotary embeddings)")
    if is_mla(args):  # DeepSeek-V3, MoE and MTP included (checkpoint/mla.py)
        return mla_config(args, state)
    if is_moe(args, state):  # Qwen3-MoE / Qwen2-MoE / Mixtral (megatron_checkpoint_moe)
        if not _arg(args, "num_experts"):
            raise UsageError("the Megatron-LM checkpoint has MoE layers but its args carry no --num-experts — "
                             "give the HF config (--hf-config DIR)")
        return moe_config(args, fields, qkv_bias)
    if model_type == "llama":
        fields["attention_bias"] = False
        fields["mlp_bias"] = False
    return AutoConfig.for_model(model_type, **fields)


def convert_megatron_checkpoint(path: os.PathLike | str, out_dir: os.PathLike | str,
                                dtype: Optional[torch.dtype] = None, hf_config: Optional[str] = None) -> Path:
    """Writes the HF directory of a Megatron-LM checkpoint (no tokenizer: Megatron's checkpoints carry none)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2_backend.checkpoint.hf_export import write_hf_dir

    state, args, _ = read_megatron_checkpoint(path)
    config = AutoConfig.from_pretrained(hf_config) if hf_config else hf_config_from_args(args, state)
    hf_state = to_hf_state_dict(state, config)
    if dtype is not None:
        hf_state = {k: v.to(dtype) for k, v in hf_state.items()}
        config.dtype = dtype
    else:
        config.dtype = hf_state["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    attach_mtp_layers(model, config)  # its MTP layers: written as the HF layout keeps them (models/mtp_layouts.py)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if set(hf_state) != expected:
        raise UsageError(f"{path}: the Megatron-LM weights do not fill {type(model).__name__}: missing "
                         f"{sorted(expected - set(hf_state))[:4]}, unexpected {sorted(set(hf_state) - expected)[:4]}")
    write_hf_dir(model, hf_state, Path(out_dir))
    return Path(out_dir)


__all__ = ["read_megatron_checkpoint",
           "legacy_rank_groups", "hf_config_from_args", "to_hf_state_dict", "convert_megatron_checkpoint"]
