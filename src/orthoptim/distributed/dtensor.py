"""DTensor access that works on every torch build: the classes (empty tuples where torch has no
distributed support, so ``isinstance`` is always False), a rank's block, and torch.chunk's split
(``shard_rows``, the rule every exchange sizes the ranks' blocks by)."""

from __future__ import annotations

from torch import Tensor

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = Replicate = Shard = ()  # type: ignore[assignment,misc]
    distribute_tensor = None
try:  # DTensor's own rule for a rank's block (private; chunked_local_shape's own rule where it is missing)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _dtensor_local_shape
except ImportError:
    _dtensor_local_shape = None


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows (or columns) each rank holds under ``Shard(0)`` (torch.chunk semantics: the last ranks may hold 0)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def local_tensor(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a view: in-place updates land in the DTensor), or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def storage_address(t: Tensor) -> int:
    """The address of a tensor's (a DTensor's local block's) first element: new whenever ``.data`` is
    replaced or the tensor converted or moved. A DTensor's own data_ptr() is 0; its block's is read
    without to_local's view."""
    return (t._local_tensor if isinstance(t, DTensor) else t).data_ptr()


def chunked_local_shape(p: Tensor) -> tuple[int, ...]:
    """The shape of this rank's block of a DTensor under torch.chunk-style sharding, as DTensor and
    FSDP2 split it: each Shard(d) in mesh-dimension order splits what the earlier ones left."""
    if _dtensor_local_shape is not None:
        return tuple(_dtensor_local_shape(p.shape, p.device_mesh, p.placements)[0])
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            sizes = shard_rows(shape[placement.dim], p.device_mesh.size(mesh_dim))
            shape[placement.dim] = sizes[p.device_mesh.get_local_rank(mesh_dim)]
    return tuple(shape)
