"""Memory per rank, estimated from the config before anything is built, and the refusal of what cannot fit.

`estimate_memory(config, world_size)` counts the model's parameters from its config keys (`parameter_counts`: as
Megatron-LM estimates from its arguments; torch-free, so --dry-run prints it in a fraction of a second) and
prices one rank's share of a training step:

- model states, sharded by FSDP2 over tp × the FSDP shard group (× cp, which FSDP shards over too; experts over
  ep × ep_fsdp): fp32 parameters (the optimizer's master copy: parallel/fsdp.py keeps parameters fp32), fp32
  gradients, and the optimizer's states (AdamW: two fp32 moments; SGD/momentum-like: one);
- gathered layers: FSDP2 unshards a layer (and prefetches the next) in the compute dtype, and holds the whole
  embedding and output layer and their gradients during the step (DESIGN.md: most of a small model's peak);
- activations of one micro-batch (micro-batch × seq_length / cp tokens) saved for backward, per decoder layer:
  the attention block's inputs and outputs (7h + 2·kv), the MLP's input and its 4 intermediates (h + 4·F, with F
  × top-k for MoE layers), in the compute dtype, split by tp; with recompute, each layer's input only plus one
  layer's full set; the logits (compute dtype plus fp32 for the loss and its gradient), split by tp.

It leaves out the runtime (interpreter, CUDA context, allocator caches, communication buffers): a lower bound of
what the step needs, so a refusal is never for a run that would have fit. `fit_errors` refuses an estimate
over the device's memory (CUDA) or over the host memory available to each of this host's ranks (CPU; and the
host part under cpu_offload), with the numbers. benchmarks/bench_memory_estimate.py prints the estimate beside
a measured peak, and the parameter count beside the built model's. Torch-free but for the device probe.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from fsdp2_backend.config.layout import parallel_layout
from fsdp2_backend.config.model_facts import model_facts

GIB = float(1 << 30)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes, by part (see the module docstring)."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    activations: int
    logits: int
    shards: int                 # the ranks one dense parameter is sharded over
    tokens: Tuple[int, int]     # (micro-batch, tokens per sample on this rank)
    offloaded: bool             # model states in host memory (cpu_offload)

    @property
    def states(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.gathered + self.activations + self.logits

    def breakdown(self) -> str:
        where = " (in host memory: cpu_offload)" if self.offloaded else ""
        return (f"{size(self.total)} = parameters {size(self.parameters)} + gradients {size(self.gradients)} + "
                f"optimizer states {size(self.optimizer)} (fp32, sharded over {self.shards}{where}) + gathered layers "
                f"{size(self.gathered)} + activations {size(self.activations)} (micro-batch {self.tokens[0]} x "
                f"{self.tokens[1]} tokens) + logits {size(self.logits)}")

    def line(self) -> str:
        return f"memory estimate per rank: {self.breakdown()}; the runtime comes on top"


def size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def _model_values(config) -> Dict[str, Any]:
    """The model's HF config keys as validation reads them (config.json, the resumed checkpoint's, the
    architecture flags over them); a multimodal config's text part."""
    facts = model_facts(config, [])
    values = {**(facts.config_json or {}), **{k: v for k, v in (config.model.architecture or {}).items()
                                               if v is not None}}
    text = values.get("text_config")
    return {**values, **text} if isinstance(text, dict) else values


def _get(values: Dict[str, Any], *keys: str) -> Optional[int]:
    for key in keys:
        if values.get(key) is not None:
            return values[key]
    return None


def parameter_counts(values: Dict[str, Any], vocab_fallback: Optional[int] = None) -> Dict[str, int]:
    """Parameters of a decoder-only HF model from its config keys (biases and per-head norms left out): dense,
    experts, the embedding and output layer, the largest decoder layer; and the widths activations need. The way
    Megatron-LM estimates from its arguments (training/theoretical_memory_usage.py), over HF's key names."""
    h = _get(values, "hidden_size", "n_embd", "d_model")
    layers = _get(values, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(values, "num_attention_heads", "n_head")
    if not (h and layers and heads):
        raise ValueError("the model config names no hidden size, layer count or head count")
    kv_heads = _get(values, "num_key_value_heads", "num_attention_groups") or heads
    head_dim = _get(values, "head_dim") or h // heads
    vocab = _get(values, "vocab_size") or vocab_fallback or 0
    ffn = _get(values, "intermediate_size", "n_inner", "ffn_hidden_size") or 4 * h
    mats = 2 if values.get("model_type") in ("gpt2", "gpt_bigcode", "gpt_neox", "opt") else 3  # gated: gate+up+down
    kv_lora = _get(values, "kv_lora_rank")
    if kv_lora:  # multi-head latent attention (DeepSeek-V3 keys)
        rope, nope = _get(values, "qk_rope_head_dim") or 0, _get(values, "qk_nope_head_dim") or head_dim
        v_dim, q_lora = _get(values, "v_head_dim") or head_dim, _get(values, "q_lora_rank")
        attention = ((h * q_lora + q_lora * heads * (nope + rope)) if q_lora else h * heads * (nope + rope))
        attention += h * (kv_lora + rope) + kv_lora * heads * (nope + v_dim) + heads * v_dim * h
        kv_width = kv_lora + rope
    else:
        attention = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h
        kv_width = 2 * kv_heads * head_dim
    experts = _get(values, "n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts") or 0
    expert_ffn = _get(values, "moe_intermediate_size") or ffn
    shared = (_get(values, "n_shared_experts") or 0) * mats * h * expert_ffn
    shared += mats * h * (_get(values, "shared_expert_intermediate_size") or 0)
    dense_layers = min(_get(values, "first_k_dense_replace") or 0, layers) if experts else layers
    moe_layers = layers - dense_layers
    dense_layer = attention + mats * h * ffn + 2 * h
    moe_layer_dense_part = attention + 2 * h + h * experts + shared  # attention, norms, router, shared experts
    ends = vocab * h * (1 if values.get("tie_word_embeddings", False) else 2)
    positions = (_get(values, "n_positions") or 0) * h if mats == 2 else 0  # GPT-2's learned positions
    top_k = _get(values, "num_experts_per_tok", "moe_topk") or 0
    return {
        "dense": dense_layers * dense_layer + moe_layers * moe_layer_dense_part + h + ends + positions,
        "experts": moe_layers * experts * mats * h * expert_ffn,
        "ends": ends,
        "largest_layer": max(dense_layer if dense_layers else 0,
                             moe_layer_dense_part + experts * mats * h * expert_ffn if moe_layers else 0),
        "hidden": h, "layers": layers, "vocab": vocab, "kv_width": kv_width,
        # the widths one token's MLP saves: the dense one, or its routed and shared experts'
        "ffn_width": (top_k * expert_ffn + (shared // (mats * h) if shared else 0)) if moe_layers and top_k
        else ffn,
    }


def _optimizer_states(name: str) -> int:
    """fp32 states per parameter."""
    return 1 if name.lower() in ("sgd", "muon") else 2


def estimate_memory(config, world_size: int) -> MemoryEstimate:
    """One rank's memory for a training step of `config` at `world_size` (see the module docstring). ValueError
    when the model's config is not there to read."""
    layout = parallel_layout(config.parallel, world_size)
    counts = parameter_counts(_model_values(config), config.model.vocab_size)
    shards = layout.tp * max(layout.dp_shard, 1) * layout.cp
    expert_shards = layout.ep * layout.ep_fsdp if layout.ep > 1 else shards
    sharded = counts["dense"] / shards + counts["experts"] / expert_shards
    p, t = config.parallel, config.training
    cb = DTYPE_BYTES.get(p.param_dtype, 4)
    h = counts["hidden"]
    mbs, seq = t.per_device_train_batch_size, -(-config.data.cutoff_len // layout.cp)
    tokens = mbs * seq
    per_layer = tokens * (7 * h + counts["kv_width"] + 4 * counts["ffn_width"]) * cb // layout.tp
    if p.recompute:
        activations = counts["layers"] * tokens * h * cb + per_layer
    else:
        activations = counts["layers"] * per_layer
    logits = tokens * counts["vocab"] // layout.tp * (cb + 8)
    gathered = (2 * counts["largest_layer"] + counts["ends"]) // layout.tp * cb * 2
    return MemoryEstimate(parameters=int(sharded * 4), gradients=int(sharded * 4),
                          optimizer=int(sharded * 4 * _optimizer_states(t.optimizer)), gathered=int(gathered),
                          activations=int(activations), logits=int(logits), shards=shards, tokens=(mbs, seq),
                          offloaded=bool(p.cpu_offload))


def host_memory_available() -> Optional[int]:
    """MemAvailable of /proc/meminfo (Linux), or None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _device_memory() -> Optional[int]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory
    return None  # NPU and others: not checked


ADVICE = ("lower --micro-batch-size (training.per_device_train_batch_size) or --seq-length (data.cutoff_len), shard "
          "more (more ranks, --tensor-model-parallel-size, --context-parallel-size), or set --recompute-activations "
          "(parallel.recompute)")


def fit_errors(estimate: MemoryEstimate, world_size: int, device: Optional[int] = None,
               host: Optional[int] = None, on_cpu: Optional[bool] = None) -> List[str]:
    """What cannot fit: `device` bytes per accelerator, `host` bytes available on this host (its ranks share
    them); read from the machine when not given."""
    if on_cpu is None:
        device = _device_memory() if device is None else device
        on_cpu = device is None
    host = host_memory_available() if host is None else host
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    errors = []
    on_host = estimate.total if on_cpu else (estimate.states if estimate.offloaded else 0)
    on_device = 0 if on_cpu else estimate.total - (estimate.states if estimate.offloaded else 0)
    if on_host and host is not None and on_host * local > host:
        errors.append(f"memory: about {estimate.breakdown()} per rank — {local} rank(s) on this host need "
                      f"{size(on_host * local)} and {size(host)} of host memory is available; {ADVICE}")
    if on_device and device is not None and on_device > device:
        errors.append(f"memory: about {estimate.breakdown()} per rank — more than the device's {size(device)}; "
                      f"{ADVICE}")
    return errors
