"""Memory per rank, estimated from the config before anything is built, and the refusal of what cannot fit.

`estimate_memory(config, model_args, world_size)` counts the model's parameters on the meta device (exact for
any model id: no formula per architecture, nothing allocated) and prices one rank's share of a training step:

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
what the step needs, so a refusal is never for a run that would have fit. `check_fits` refuses an estimate
over the device's memory (CUDA) or over the host memory available to each of this host's ranks (CPU; and the
host part under cpu_offload), with the numbers. benchmarks/bench_memory_estimate.py prints the estimate beside
a measured peak.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from fsdp2_backend.config.layout import parallel_layout
from fsdp2_backend.usage_errors import UsageError

GIB = float(1 << 30)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LAYER = re.compile(r"(^|\.)layers\.\d+$")


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


def _counts(model) -> Tuple[int, int, int, int]:
    """(dense parameters, expert parameters, embedding + output parameters, largest decoder layer's)."""
    dense = experts = 0
    for name, p in model.named_parameters():  # tied weights once
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    ends = {id(m.weight): m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None and getattr(m, "weight", None) is not None}
    layers = [sum(p.numel() for p in m.parameters()) for n, m in model.named_modules() if LAYER.search(n)]
    return dense, experts, sum(ends.values()), max(layers, default=0)


def _hf_config(config, model_args, tp: int):
    from fsdp2_backend.data.tokenizer import load_tokenizer, model_vocab_size
    from fsdp2_backend.models.loading import load_hf_config, weights_available

    hf_config = load_hf_config(model_args)
    arch = config.model.architecture or {}
    if not weights_available(model_args) and arch and not arch.get("vocab_size"):  # sized by its tokenizer
        hf_config.vocab_size = model_vocab_size(model_args, None, load_tokenizer(model_args), from_checkpoint=False,
                                                tp_size=tp)
    return hf_config


def _optimizer_states(name: str) -> int:
    """fp32 states per parameter."""
    return 1 if name.lower() in ("sgd", "muon") else 2


def estimate_memory(config, model_args, world_size: int) -> MemoryEstimate:
    """One rank's memory for a training step of `config` at `world_size` (see the module docstring)."""
    from fsdp2_backend.models.loading import build_model

    from transformers.utils import logging as hf_logging

    layout = parallel_layout(config.parallel, world_size)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the config's warnings are the build's to say, once
    try:
        hf_config = _hf_config(config, model_args, layout.tp)
        model = build_model(model_args, hf_config, on_meta=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    dense, experts, ends, layer = _counts(model)
    shards = layout.tp * max(layout.dp_shard, 1) * layout.cp
    expert_shards = layout.ep * layout.ep_fsdp if layout.ep > 1 else shards
    sharded = dense / shards + experts / expert_shards
    p, t = config.parallel, config.training
    cb = DTYPE_BYTES.get(p.param_dtype, 4)
    text = getattr(hf_config, "text_config", None) or hf_config
    h = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    ffn = getattr(text, "intermediate_size", None) or 4 * h
    topk, expert_ffn = getattr(text, "num_experts_per_tok", None), getattr(text, "moe_intermediate_size", None)
    if topk and expert_ffn:  # a token's routed and shared experts
        ffn = (topk + (getattr(text, "n_shared_experts", None) or 0)) * expert_ffn
    num_layers = text.num_hidden_layers
    mbs, seq = t.per_device_train_batch_size, -(-config.data.cutoff_len // layout.cp)
    tokens = mbs * seq
    per_layer = tokens * (7 * h + 2 * kv + 4 * ffn) * cb // layout.tp
    if p.recompute:
        activations = num_layers * tokens * h * cb + per_layer
    else:
        activations = num_layers * per_layer
    vocab = text.vocab_size
    logits = tokens * vocab // layout.tp * (cb + 8)
    gathered = (2 * layer + ends) // layout.tp * cb * 2
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
