"""How Dion sees a sharded matrix: which process group splits its rows and which its columns.

Dion never assembles a sharded matrix. B = M + G stays in blocks B_ij (rows split over one group,
columns over another) and only its low-rank factors travel (see ``low_rank.py``). This module reads
a parameter's DTensor placements, matches each sharded mesh dimension with ``outer_shard_mesh`` or
``inner_shard_mesh`` and refuses what the factorization cannot run exactly: a dimension sharded
twice, a mesh dimension that is neither mesh, or a placement that is not a plain ``Shard``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist

from orthoptim.distributed.dtensor import shard_rows


@dataclass(frozen=True)
class FactorSharding:
    """The split of one 2-D matrix: ``rows_group`` / ``cols_group`` are None where that dim is whole."""

    rows_group: dist.ProcessGroup | None
    cols_group: dist.ProcessGroup | None
    rows_by: str | None  # "outer_shard_mesh" / "inner_shard_mesh": the same on every rank (megabatch key)
    cols_by: str | None
    local_rows: int
    local_cols: int
    col_offset: int  # first column of this rank's block

    @property
    def key(self) -> tuple[str | None, str | None]:
        return (self.rows_by, self.cols_by)


def _ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _chunk(size: int, group: dist.ProcessGroup, mesh_rank: int) -> tuple[int, int]:
    """(length, offset) of this rank's torch.chunk-style (FSDP2, DTensor ``Shard``) block."""
    counts = shard_rows(size, dist.get_world_size(group))
    return counts[mesh_rank], sum(counts[:mesh_rank])


def factor_sharding(p, name: str, meshes: dict[str, dist.ProcessGroup | None]) -> FactorSharding:
    """The ``FactorSharding`` of a DTensor parameter ``p`` for Dion: a 2-D matrix, or a flattened
    tensor [out, in·kh·kw] sharded along dim 0 only.

    ``meshes`` maps "outer_shard_mesh" and "inner_shard_mesh" to the groups the user passed.
    Raises ValueError naming the parameter, its placements and the fix.
    """
    from torch.distributed.tensor import Replicate, Shard

    where = f"parameter {name} (a DTensor with placements {tuple(p.placements)})"
    known = {label: _ranks(g) for label, g in meshes.items() if g is not None}
    by_dim: dict[int, tuple[str, dist.ProcessGroup, int]] = {}
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        allowed = (0, 1) if p.ndim == 2 else (0,)
        if type(placement) is not Shard or placement.dim not in allowed:
            raise ValueError(
                f"{where}: Dion runs on plain Shard(0)/Shard(1) placements of a 2-D matrix (Shard(0) of a "
                f"flattened one), not {placement}; shard it on dims {allowed} only, one dim per mesh dimension"
            )
        group = p.device_mesh.get_group(mesh_dim)
        label = next((lab for lab, ranks in known.items() if ranks == _ranks(group)), None)
        if label is None:
            raise ValueError(
                f"{where}: mesh dimension {mesh_dim} shards it, but that group matches neither "
                f"outer_shard_mesh nor inner_shard_mesh; pass the sub-mesh of that dimension as one of them "
                "to orthoptim.Dion (outer_shard_mesh for FSDP, inner_shard_mesh for tensor parallelism; a "
                "Dion group in another optimizer has only distributed_mesh, its outer_shard_mesh)"
            )
        dim = placement.dim
        if dim in by_dim:
            raise ValueError(
                f"{where}: it is sharded twice along dim {dim} (by {by_dim[dim][0]} and {label}); Dion "
                "factors B = M + G only when outer_shard_mesh and inner_shard_mesh split different dims. "
                "Shard it along the other dim on one of the meshes (e.g. Shard(0) for FSDP, Shard(1) for "
                "row-parallel TP), or use Dion3/Muon, which assemble such matrices"
            )
        by_dim[dim] = (label, group, p.device_mesh.get_local_rank(mesh_dim))
    whole = (p.shape[0], math.prod(p.shape[1:]))
    sizes = []
    for dim in (0, 1):
        if dim in by_dim:
            _, group, mesh_rank = by_dim[dim]
            sizes.append(_chunk(whole[dim], group, mesh_rank))
        else:
            sizes.append((whole[dim], 0))
    local = p.to_local()
    if (local.shape[0], math.prod(local.shape[1:])) != (sizes[0][0], sizes[1][0]):  # see _check_blocks
        raise ValueError(
            f"{where}: its local block has shape {tuple(local.shape)}, but torch.chunk-style sharding of "
            f"{tuple(p.shape)} gives {(sizes[0][0], sizes[1][0])}; only DTensor/FSDP2-style sharding is supported"
        )
    rows, cols = by_dim.get(0), by_dim.get(1)
    return FactorSharding(
        rows_group=rows[1] if rows else None, cols_group=cols[1] if cols else None,
        rows_by=rows[0] if rows else None, cols_by=cols[0] if cols else None,
        local_rows=sizes[0][0], local_cols=sizes[1][0], col_offset=sizes[1][1],
    )
