"""Sharded parameters (DTensors): which layouts the step runs exactly, how each parameter is treated
(``_layout``), and the collectives that belong to the optimizer rather than to one megabatch
(gradient averaging and the momentum sync over ``replicate_mesh``, Dion's right factors of expert
shards).

``ShardedParameters`` is a part of ``OrthonormalOptimizer`` (``optim/base.py``); it reads the
optimizer's meshes (``_process_group``, ``_replicate_group``, ``_inner_group``), ``state``,
``comm_stats``, ``param_name`` and its verdict groups (``GradientChecks._verdict_groups``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed import megabatches
from orthoptim.distributed.dtensor import (
    DTensor,
    Replicate,
    Shard,
    chunked_local_shape,
    local_tensor,
    shard_rows,
)
from orthoptim.distributed.factor_sharding import FactorSharding, factor_sharding
from orthoptim.optim.validation import MATRIX_ALGORITHMS


class ShardedParameters:
    """DTensor parameters: checked at construction, laid out per step."""

    def _init_sharding(self) -> None:
        # Read once per parameter (placements never change): Dion's split of a sharded matrix, and
        # whether its one sharded mesh dim is distributed_mesh.
        self._factor_specs: dict[Tensor, FactorSharding] = {}
        self._over_distributed_mesh: dict[Tensor, bool] = {}
        # replicate_mesh: eager steps since the replicas' Dion momenta were last averaged, and how many
        # are allowed (None: only when a state dict is taken); see synchronize_replicas.
        self._steps_since_replica_sync = 0
        self._replica_sync_every: int | None = None

    def _check_blocks(self, params: list[Any], labels: list[str], index: int) -> None:
        """Every sharded DTensor must hold torch.chunk's block (FSDP2's and distribute_tensor's split):
        the exchanges size every rank's block that way, so another block would fail or hang in the
        first step. Agreed on by every rank before any other check, over the groups the step's
        verdicts use (``_verdict_groups``): a rank whose own blocks match must raise too, not wait in a
        collective for the ranks that raised."""
        sharded = [(p, label) for p, label in zip(params, labels) if isinstance(p, DTensor) and
                   any(not isinstance(pl, Replicate) for pl in p.placements)]
        if not sharded:
            return
        chunks, orders = [], []  # this rank's blocks that are not torch.chunk's; meshes out of order
        for p, label in sharded:
            where = f"parameter {label} (a DTensor with placements {tuple(p.placements)})"
            expected, held = chunked_local_shape(p), tuple(local_tensor(p).shape)
            if held != tuple(expected):
                chunks.append(f"{where} holds a block of shape {held} of its {tuple(p.shape)} on this rank, but "
                              f"torch.chunk-style sharding gives {tuple(expected)}; only torch.chunk-style shards "
                              "(FSDP2's, distribute_tensor's) are supported")
            for dim, placement in enumerate(p.placements):
                # DTensor gives block i to the mesh's i-th rank, the exchanges to the group's i-th rank:
                # the same only where the mesh lists its ranks in ascending order.
                if isinstance(placement, Replicate):
                    continue
                position, rank = p.device_mesh.get_coordinate()[dim], dist.get_rank(p.device_mesh.get_group(dim))
                if position != rank:
                    orders.append(f"{where} is on a device mesh that lists its ranks out of ascending order along "
                                  f"dimension {dim} (this process is position {position} there, rank {rank} of its "
                                  "process group); build the mesh with its ranks in ascending order, as "
                                  "init_device_mesh does")
        flags = torch.tensor([len(chunks), len(orders)], dtype=torch.int32, device=local_tensor(sharded[0][0]).device)
        for group in self._verdict_groups([p for p, _ in sharded]):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        chunked, ordered = (int(f) for f in flags.tolist())
        if chunked or ordered:
            found = [*chunks, *orders]
            raise ValueError(found[0] if found else (
                f"another rank holds a block of a parameter of param group {index} that is not torch.chunk's "
                "(its error names it)" if chunked else
                f"a parameter of param group {index} is on a device mesh that lists its ranks out of ascending "
                "order (another rank's error names it); build the mesh with its ranks in ascending order, as "
                "init_device_mesh does"))

    def _check_dtensor(self, p: Tensor, group: dict[str, Any], label: str) -> None:
        """Sharded layouts this version runs exactly; anything else is an error, never a silent fallback."""
        where = f"parameter {label} (a DTensor with placements {tuple(p.placements)})"
        if group["transpose"] and group["algorithm"] in MATRIX_ALGORITHMS and \
                self._layout(p, group) not in ("replicated", "local"):
            raise ValueError(
                f"{where}: transpose=True runs on whole matrices only (one process, DDP, or a batch of matrices "
                f"sharded on dim 0), not on the {self._layout(p, group)} layout; to shard it, read it as stored: "
                "transpose=False in its group (orthoptim.param_groups sets transpose=True for Conv1D and "
                "transposed-conv weights: pass overrides={'<its name pattern>': {'transpose': False}}), or store "
                "the weight as [out, in]")
        if self._layout(p, group) == "factor_sharded":
            if self._process_group is None and self._inner_group is None:
                raise ValueError(f"{where}: pass outer_shard_mesh=<its FSDP mesh> and/or "
                                 "inner_shard_mesh=<its tensor-parallel mesh> to Dion")
            self._factor_spec(p, label)
            return
        if self._process_group is None and (self._inner_group is None or group["algorithm"] in MATRIX_ALGORITHMS):
            raise ValueError(f"{where}: pass distributed_mesh=<the 1-D shard mesh or its ProcessGroup>")
        sharded = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
        if group["algorithm"] not in MATRIX_ALGORITHMS or len(sharded) != 1:
            return  # elementwise rules, replicated matrices and gathered (e.g. FSDP x TP) matrices
        layout = self._layout(p, group)
        if type(p.placements[sharded[0]]) is not Shard or p.placements[sharded[0]].dim != 0:
            return
        if p.device_mesh.size(sharded[0]) != dist.get_world_size(self._process_group):
            raise ValueError(
                f"{where}: its shard mesh dimension has {p.device_mesh.size(sharded[0])} ranks but "
                f"distributed_mesh has {dist.get_world_size(self._process_group)}; pass the mesh (for HSDP "
                "the shard sub-mesh, e.g. mesh['shard']) the parameter is sharded over")
        if layout == "row_sharded" and not self._sharded_over_distributed_mesh(p):
            # Same size, other ranks (e.g. HSDP's replicate sub-mesh): rows would be assembled from
            # replicas instead of shards.
            shard_ranks = dist.get_process_group_ranks(p.device_mesh.get_group(sharded[0]))
            raise ValueError(
                f"{where}: it is sharded over ranks {shard_ranks} but distributed_mesh holds ranks "
                f"{dist.get_process_group_ranks(self._process_group)}; pass the mesh the parameter is sharded "
                "over (for HSDP the shard sub-mesh, e.g. mesh['shard'])")

    def _dion_meshes(self) -> dict[str, dist.ProcessGroup | None]:
        return {"outer_shard_mesh": self._process_group, "inner_shard_mesh": self._inner_group}

    def _factor_spec(self, p: Tensor, label: str | None = None) -> FactorSharding:
        if p not in self._factor_specs:
            self._factor_specs[p] = factor_sharding(p, label or self.param_name(p), self._dion_meshes())
        return self._factor_specs[p]

    def _layout(self, p: Tensor, group: dict[str, Any]) -> str:
        """How the step treats a parameter:

        - "replicated": whole on every rank (or a single process); DDP shares the batch of work;
        - "row_sharded": FSDP2 ``Shard(0)`` of a matrix over ``distributed_mesh`` (possibly replicated
          over other mesh dims, HSDP): rows are assembled at an owner rank and sent back;
        - "local": ``Shard(0)`` of a batch of matrices: each rank owns whole matrices, no communication;
        - "factor_sharded": Dion's matrices sharded along rows and/or columns (FSDP, TP, both):
          the blocks stay where they are and only low-rank factors are all-reduced;
        - "column_sharded": Dion3 matrices (and Dion2 ones that select rows) with ``Shard(1)`` over
          ``distributed_mesh`` (tensor parallelism): rows are selected from all-reduced norms and only
          the selected rows' column blocks travel, to an owner rank per matrix and back
          (distributed/column_exchange.py);
        - "gathered": any other sharding (``Shard(1)``, FSDP x TP, heads/splits on row shards): the
          momentum and gradient are all-gathered, the rule runs on whole matrices with the work
          shared over ``distributed_mesh``, and each rank keeps its block of the result.
        """
        if not isinstance(p, DTensor):
            return "replicated"
        sharded = [pl for pl in p.placements if not isinstance(pl, Replicate)]
        if not sharded:
            return "replicated"
        if group["algorithm"] == "dion" and (p.ndim == 2 or group["flatten"]) and \
                group["num_heads"] is None and group["split_sizes"] is None:
            return "factor_sharded"
        plain = group["num_heads"] is None and group["split_sizes"] is None
        if len(sharded) == 1 and type(sharded[0]) is Shard and sharded[0].dim == 0:
            if p.ndim == 3 and not group["flatten"]:
                return "local"
            if plain:
                return "row_sharded"
        # Dion3 selects rows; Dion2 too where rows are the shorter side (a tall one picks columns).
        selects_rows = group["algorithm"] == "dion3" or (group["algorithm"] == "dion2" and p.shape[0] <= p.shape[1])
        if len(sharded) == 1 and type(sharded[0]) is Shard and sharded[0].dim == 1 and p.ndim == 2 and plain \
                and selects_rows and self._sharded_over_distributed_mesh(p):
            return "column_sharded"
        return "gathered"

    def _sharded_over_distributed_mesh(self, p: Tensor) -> bool:
        if p not in self._over_distributed_mesh:
            dim = self._sharded_mesh_dim(p)  # its first (here: only) sharded mesh dimension
            self._over_distributed_mesh[p] = self._process_group is not None and \
                dist.get_process_group_ranks(p.device_mesh.get_group(dim)) == \
                dist.get_process_group_ranks(self._process_group)
        return self._over_distributed_mesh[p]

    @staticmethod
    def _sharded_mesh_dim(p: Tensor) -> int:
        """The first mesh dimension ``p`` is sharded over (for a Shard(0) batch of experts: the one that splits it)."""
        return next(i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate))

    @staticmethod
    def _shard_counts(p: Tensor, batched: bool) -> tuple[int, int]:
        """How many shards split the rows and the columns of a parameter's matrices (``batched``: a
        [batch, rows, cols] tensor, whose dim 0 splits whole matrices)."""
        rows = cols = 1
        first = 1 if batched else 0
        for mesh_dim, placement in enumerate(getattr(p, "placements", ())):
            if isinstance(placement, Shard) and placement.dim >= first:
                if placement.dim == first:
                    rows *= p.device_mesh.size(mesh_dim)
                else:
                    cols *= p.device_mesh.size(mesh_dim)
        return rows, cols

    def _local_batch_range(self, p: Tensor) -> tuple[int, int, int]:
        """For a ``Shard(0)`` batch of matrices (torch.chunk-style): the mesh dimension it is sharded
        over, the index of this rank's first matrix and how many it holds."""
        dim = self._sharded_mesh_dim(p)
        sizes = shard_rows(p.shape[0], p.device_mesh.size(dim))
        rank = p.device_mesh.get_local_rank(dim)
        return dim, sum(sizes[:rank]), sizes[rank]

    def _share_local_right_factors(self, p: Tensor) -> None:
        """Dion on a ``Shard(0)`` batch of matrices: each rank updated the right factors of its own
        matrices; all-gather them, so that Q is the same whole tensor on every rank (as the state of
        every other layout is) and a checkpoint saved from any rank holds every matrix's."""
        q = self.state[p]["Q"]
        per_batch = q.view(p.shape[0], -1, *q.shape[1:])  # [batch, blocks of one matrix, cols, r]
        dim, first, count = self._local_batch_range(p)
        own = per_batch[first: first + count]
        placements = [Shard(0) if i == dim else Replicate() for i in range(p.device_mesh.ndim)]
        whole = DTensor.from_local(own.contiguous(), p.device_mesh, placements, shape=per_batch.shape,
                                   stride=per_batch.stride())
        per_batch.copy_(whole.full_tensor())
        if self.comm_stats is not None:
            self.comm_stats.record("all_gather", q.numel() * q.element_size())

    def _average_gradients(self, work: list[tuple[dict, list[Tensor]]]) -> None:
        """Average over ``replicate_mesh`` every gradient that Dion's low-rank sync does not cover,
        one all-reduce per dtype (the Dion matrices exchange only P and R, in their rule)."""
        self._mean_over_replicas([local_tensor(p.grad) for group, ps in work if group["algorithm"] != "dion"
                                  for p in ps])

    def _mean_over_replicas(self, tensors: list[Tensor], *, in_fp32: bool = False) -> None:
        """Average ``tensors`` in place over ``replicate_mesh``, one all-reduce per dtype and device;
        ``in_fp32``: bf16/fp16 ones are summed in fp32 and rounded once (the momentum sync: exact
        enough to be invisible, and rare enough for the bytes not to matter)."""
        world = dist.get_world_size(self._replicate_group)
        for batch in megabatches(tensors, key=lambda t: (t.dtype, t.device)):
            flat = torch.cat([t.reshape(-1) for t in batch])
            if in_fp32:
                flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
            # fp16 is divided first: the sum of finite fp16 values can overflow (65504), their mean not.
            narrow = flat.dtype == torch.float16
            if narrow:
                flat /= world
            dist.all_reduce(flat, group=self._replicate_group)
            if self.comm_stats is not None:
                self.comm_stats.record("all_reduce", flat.numel() * flat.element_size())
            if not narrow:
                flat /= world
            torch._foreach_copy_(batch, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in batch]), batch)])

    def synchronize_replicas(self) -> None:
        """With ``replicate_mesh`` (call it on every rank; nothing to do without one): set each rank's
        Dion momentum to the mean over the replicas, one all-reduce.

        Under compressed sync each rank keeps its own momentum M_i; the steps depend only on their mean
        (P and R are means of products linear in M_i), so replacing every M_i by the mean changes no
        later update. It bounds what each M_i holds beyond the mean (the sum of its rank's gradient
        deviations since the last sync, which no step decays): ``state_dict()`` calls it, so that a
        checkpoint (saved from any one rank, as ``torch.distributed.checkpoint`` does for replicated
        state) holds the mean, and ``step()`` every ``replica_sync_every`` steps (Dion's option)."""
        if self._replicate_group is None:
            return
        self._mean_over_replicas([local_tensor(self.state[p]["momentum"]) for g in self.param_groups
                                  if g["algorithm"] == "dion" for p in g["params"]], in_fp32=True)
        self._steps_since_replica_sync = 0
