"""Turn the user's ``distributed_mesh`` into the process group the plan communicates over."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def resolve_process_group(mesh: Any, name: str = "distributed_mesh") -> dist.ProcessGroup | None:
    """``None`` → single process; a ``ProcessGroup`` → itself; a 1-D ``DeviceMesh`` → its group."""
    if mesh is None:
        return None
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"{name} has {mesh.ndim} dimensions {mesh.mesh_dim_names}; pass a 1-D mesh "
                "(for HSDP, the shard sub-mesh, e.g. mesh['shard'])"
            )
        return mesh.get_group()
    raise TypeError(
        f"{name} must be None, a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
        f"got {type(mesh).__name__}"
    )
