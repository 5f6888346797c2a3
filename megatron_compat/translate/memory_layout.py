"""Megatron's HSDP and host-offload flags → the native `parallel` fields.

- `--num-distributed-optimizer-instances N`: N replicas of the distributed optimizer, each sharded over
  data-parallel size / N ranks — HSDP with N replicate groups: `parallel.fsdp_size` = dp / N (counted with
  context-parallel ranks inside, as that field counts). `--outer-dp-sharding-strategy` names what the outer
  (replicate) dimension shards: `no_shard` is HSDP as it is here; `optim` (optimizer state also sharded across
  the replicas) has the same results, with the state replicated across the groups here — said once.
- `--optimizer-cpu-offload` → `parallel.cpu_offload` (FSDP2's CPUOffloadPolicy: the optimizer state and step
  on the host, and the sharded parameters and gradients with them); only the whole state can go
  (`--optimizer-offload-fraction` 1.0), another fraction is declined.
- `--cpu-offloading-num-layers K` → `parallel.activation_offload_layers` K (the first K decoder layers' saved
  activations on the host); `--cpu-offloading-retain-pinned-cpu-buffers` is a buffer-reuse detail, no effect.
- MindSpeed-LLM's `--activation-offload` (its FSDP2 flag until 5ac89358, March 2026: every decoder layer's input,
  as saved for backward, copied to the host asynchronously) → `parallel.activation_offload_layers` -1: every
  decoder layer's saved activations on the host (a superset: the same results, less device memory). MindSpeed
  paired it with recompute (offloading the recomputed layers' inputs); whole-layer offload and recompute do not
  combine here, so that pairing is declined with the reason.
"""
from __future__ import annotations

from megatron_compat.translate.handler_table import handles


def _data_parallel(ctx) -> int:
    # pipeline stages are folded into data parallel here (handlers._pipeline), so they count as dp ranks
    tp, cp = ctx.get("tensor_model_parallel_size") or 1, ctx.get("context_parallel_size") or 1
    return max(ctx.world_size // (tp * cp), 1)


@handles("num_distributed_optimizer_instances", "parallel.fsdp_size = data-parallel size / N (HSDP, N replicas)")
def _optimizer_instances(ctx, value):
    if not value or value == 1:
        return
    dp, cp = _data_parallel(ctx), ctx.get("context_parallel_size") or 1
    if dp % value:
        tp = ctx.get("tensor_model_parallel_size") or 1
        ctx.decline("num_distributed_optimizer_instances",
                    f"{value} instances do not divide the data-parallel size {dp} (world size {ctx.world_size} / "
                    f"tp {tp} / cp {cp}), as Megatron requires — use a divisor of {dp}")
        return
    if dp == value:  # one rank per instance: plain replication, which fsdp_size cannot write (1 means all)
        ctx.warn(f"--num-distributed-optimizer-instances {value}: one rank per instance is plain replication; here "
                 f"the {dp} data-parallel ranks shard instead (the same results, less memory per rank)")
        return
    ctx.set("parallel.fsdp_size", dp // value * cp)


@handles("outer_dp_sharding_strategy", "parallel: the HSDP replicate dimension (no_shard)")
def _outer_strategy(ctx, value):
    if value == "optim" and (ctx.get("num_distributed_optimizer_instances") or 1) > 1:
        ctx.warn("--outer-dp-sharding-strategy optim: FSDP2's HSDP keeps the optimizer state replicated across the "
                 "replica groups (sharded within each) — the same results, more memory per rank than Megatron's")
    elif "outer_dp_sharding_strategy" in ctx.active and (ctx.get("num_distributed_optimizer_instances") or 1) == 1:
        ctx.record("outer_dp_sharding_strategy", "no_effect",
                   "Megatron reads it only with --num-distributed-optimizer-instances > 1 (HSDP)")


@handles("optimizer_cpu_offload", "parallel.cpu_offload (FSDP2 CPUOffloadPolicy)")
def _optimizer_offload(ctx, value):
    if value:
        ctx.set("parallel.cpu_offload", True)


@handles("optimizer_offload_fraction", "parallel.cpu_offload: the whole optimizer state (1.0)")
def _offload_fraction(ctx, value):
    if not ctx.get("optimizer_cpu_offload"):
        if "optimizer_offload_fraction" in ctx.active:
            ctx.record("optimizer_offload_fraction", "no_effect", "Megatron reads it only with --optimizer-cpu-offload")
        return
    if value != 1.0:
        ctx.decline("optimizer_offload_fraction",
                    f"{value}: FSDP2's CPU offload moves the whole sharded state (parameters, gradients, optimizer "
                    f"state) to the host, not a fraction of it — give 1.0, or drop --optimizer-cpu-offload")


@handles("cpu_offloading_num_layers", "parallel.activation_offload_layers")
def _activation_offload(ctx, value):
    if value:
        ctx.set("parallel.activation_offload_layers", value)


@handles("activation_offload", "parallel.activation_offload_layers = -1 (every decoder layer)")
def _mindspeed_activation_offload(ctx, value):
    if not value:
        return
    if ctx.get("cpu_offloading_num_layers"):
        ctx.record("activation_offload", "no_effect", "--cpu-offloading-num-layers chooses the offloaded layers")
        return
    if ctx.get("checkpoint_activations") or ctx.get("recompute_activations") or ctx.get("recompute_granularity"):
        ctx.decline("activation_offload", "MindSpeed offloads the recomputed layers' inputs; here activation offload "
                                          "keeps whole layers' saved tensors on the host and does not combine with "
                                          "recompute — drop --activation-offload or the --recompute-* flags")
        return
    ctx.set("parallel.activation_offload_layers", -1)
