"""Column-sharded matrices (tensor parallelism, ``Shard(1)``) under Dion2 / Dion3: only selected rows move.

Every rank holds all rows of a block of columns. Row selection needs each row's L1 norm over all
columns: the per-block norms are summed by one all-reduce, so every rank picks the same rows — the
rows one process would pick. The selected rows' column blocks travel to one owner rank per matrix
and back (``RowExchange`` on the transposed blocks: a column block of U is a row block of Uᵀ), so
the orthogonalization is shared and the bytes are those of the selected rows, not of M and G.
Dion3's per-row normalization needs each row's Σ O² over all columns: one more all-reduce of a
[B, k] tensor, after which every rank normalizes its own block identically.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.comm import CommStats, all_reduce
from orthoptim.distributed.dtensor import shard_rows
from orthoptim.distributed.row_exchange import RowExchange
from orthoptim.kernels.torch_backend import normalized_row_scale, row_sums_of_squares


class ColumnShardedPlan:
    """The communication around one megabatch of B column-sharded matrices of full shape rows × cols."""

    def __init__(self, group: dist.ProcessGroup, rows: int, cols: int, batch: int, stats: CommStats | None):
        self.group, self.rows, self.cols, self.batch, self.stats = group, rows, cols, batch, stats

    def select_rows(self, k: int) -> Callable[[list[Tensor]], Tensor]:
        """``select(momenta) → [B, k]`` row indices by L1 norm over all columns, the same on every rank."""

        def select(momenta: list[Tensor]) -> Tensor:
            local = torch.stack([m.abs().sum(dim=1, dtype=torch.float32) for m in momenta])  # [B, rows]
            return torch.topk(all_reduce(local, self.group, self.stats), k, dim=-1, sorted=False).indices

        return select

    def orthogonalize(self, orthogonalize: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
        """``orthogonalize`` of the whole selected rows, called with and returning this rank's column block."""
        counts = shard_rows(self.cols, dist.get_world_size(self.group))

        def on_blocks(u_local: Tensor) -> Tensor:
            exchange = RowExchange(self.group, counts, self.batch, self.stats)
            (o_t,) = exchange.run(lambda u_t: orthogonalize(u_t.mT).mT, u_local.mT)
            return o_t.mT

        return on_blocks

    def finish(self, orthogonalize: Callable[[Tensor], Tensor], beta2: float,
               eps: float) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Dion3's middle step on column blocks: ``finish(U_block, V[S]) → (Ô_block, V')``."""
        on_blocks = self.orthogonalize(orthogonalize)

        def finish(u_local: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
            work = torch.promote_types(torch.promote_types(u_local.dtype, v.dtype), torch.float32)
            o = on_blocks(u_local).to(work)
            sumsq = all_reduce(row_sums_of_squares(o), self.group, self.stats)  # Σ_j O² over every column block
            row_scale, v_new = normalized_row_scale(sumsq, v.to(work), self.cols, beta2, eps)
            return (o * row_scale.unsqueeze(-1)).to(u_local.dtype), v_new.to(v.dtype)

        return finish
