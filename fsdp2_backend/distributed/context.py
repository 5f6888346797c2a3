"""The process group and the DeviceMeshes of one run, built once from the config and passed down explicitly.

`ParallelContext` replaces Megatron's global parallel state: it holds the device, this rank's place in the
world, and the meshes every parallel plan uses:

- the world mesh `(dp_replicate, dp_shard, cp, tp)` (row-major, tp fastest, like Megatron's rank order);
- `fsdp_mesh`: the ranks that shard parameters — dp_shard x cp flattened (CP ranks hold the same parameters),
  2-D `(dp_replicate, dp_shard_cp)` for HSDP;
- `dp_mesh`: the ranks that read different data (dp_replicate x dp_shard);
- `loss_mesh`: the ranks whose tokens make up one global batch (dp x cp) — losses are reduced over it;
- `tp_mesh`, `cp_mesh`; `ep_mesh` `(ep_replicate, ep, ep_fsdp)` only when expert parallelism is on.

It works under torchrun (env:// rendezvous) and as a plain single process (a private 1-rank group).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2_backend.config import ParallelArguments, ParallelLayout, parallel_layout
from fsdp2_backend.distributed.device import DeviceInfo, resolve_device


def init_process_group(device: DeviceInfo) -> bool:
    """Joins (or creates) the default process group; True when this call created it (and must destroy it)."""
    if dist.is_initialized():
        return False
    device.set_current()
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(device.backend)
    else:
        # A plain `python pretrain_fsdp2.py`: FSDP2 still needs a group, so make a private one-rank one. Its
        # store lives in this process (no port: a port picked free and bound later can be taken in between).
        dist.init_process_group(device.backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


@dataclass
class ParallelContext:
    """Device, ranks and meshes of this run. Build with `ParallelContext.create`; `close()` at the end."""

    device: DeviceInfo
    layout: ParallelLayout
    rank: int
    world_mesh: DeviceMesh
    fsdp_mesh: DeviceMesh
    dp_mesh: DeviceMesh
    loss_mesh: DeviceMesh
    tp_mesh: DeviceMesh
    cp_mesh: DeviceMesh
    ep_mesh: Optional[DeviceMesh]
    owns_process_group: bool = False

    @classmethod
    def create(cls, parallel: ParallelArguments, device: Optional[DeviceInfo] = None) -> "ParallelContext":
        """Initialises the process group if needed and builds every mesh for `parallel`'s sizes."""
        device = device or resolve_device(parallel.distributed_backend)
        layout = parallel_layout(parallel, int(os.environ.get("WORLD_SIZE", dist.get_world_size()
                                                               if dist.is_initialized() else 1)))
        # Validation (fsdp2_backend.config.validation) accepted these sizes for this world before we got here.
        assert layout.tp * layout.cp * layout.dp == layout.world_size and layout.dp_shard > 0, layout
        owns = init_process_group(device)
        if dist.get_world_size() != layout.world_size:
            raise RuntimeError(f"WORLD_SIZE {layout.world_size} disagrees with the process group's "
                               f"{dist.get_world_size()}")
        mesh = init_device_mesh(device.type, (layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        loss_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        fsdp_mesh = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        if layout.dp_replicate > 1:
            with warnings.catch_warnings():
                # Slicing a flattened dim is the documented way to get the 2-D HSDP mesh in torch 2.x.
                warnings.simplefilter("ignore", UserWarning)
                fsdp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        ep_mesh = None
        if layout.ep > 1 or layout.ep_fsdp > 1:
            ep_replicate = layout.world_size // (layout.ep * layout.ep_fsdp)
            ep_mesh = init_device_mesh(device.type, (ep_replicate, layout.ep, layout.ep_fsdp),
                                       mesh_dim_names=("ep_replicate", "ep", "ep_fsdp"))
        return cls(device=device, layout=layout, rank=dist.get_rank(), world_mesh=mesh, fsdp_mesh=fsdp_mesh,
                   dp_mesh=dp_mesh, loss_mesh=loss_mesh, tp_mesh=mesh["tp"], cp_mesh=mesh["cp"],
                   ep_mesh=ep_mesh, owns_process_group=owns)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def dp_rank(self) -> int:
        return self.dp_mesh.get_local_rank()

    @property
    def is_last_rank(self) -> bool:
        """Megatron prints its training log from the last rank."""
        return self.rank == self.world_size - 1

    def close(self) -> None:
        """Destroys the process group if this context created it."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
