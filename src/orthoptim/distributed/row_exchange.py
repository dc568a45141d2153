"""Row-sharded matrices (FSDP2 ``Shard(0)``): assemble rows at one owner rank per matrix and back.

A megabatch holds B matrices of one full shape, each split by rows over the ranks. Matrix j is
owned by rank j // c (c = ceil(B / world)). One ``all_to_all_single`` sends every rank's rows of
matrix j (all of them for Muon, only the selected ones for Dion2/Dion3) to its owner, which now
holds whole matrices and runs the batch function on them; a second ``all_to_all_single`` sends
each rank its rows of the result. Row counts per rank follow from the shapes alone, so no sizes
are exchanged, and ranks with empty shards or no owned matrices still join both collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.comm import CommStats


def shard_rows(rows: int, world: int) -> list[int]:
    """Rows each rank holds under ``Shard(0)`` (torch.chunk semantics: the last ranks may hold 0)."""
    chunk = -(-rows // world)
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world)]


def _as_columns(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A [B, k] or [B, k, w] tensor as extra columns of ``dtype``, bit-exact (fp32 rides as 2 bf16)."""
    t = t.unsqueeze(-1) if t.ndim == 2 else t
    if t.dtype == dtype:
        return t
    if t.element_size() >= torch.empty((), dtype=dtype).element_size():
        return t.contiguous().view(dtype)
    return t.to(dtype)  # e.g. fp32 into fp64: exact


def _from_columns(cols: Tensor, like: Tensor) -> Tensor:
    """Inverse of ``_as_columns`` for a tensor shaped and typed like ``like``."""
    if cols.dtype != like.dtype:
        cols = cols.contiguous().view(like.dtype) if cols.element_size() <= like.element_size() \
            else cols.to(like.dtype)
    return cols.squeeze(-1) if like.ndim == 2 else cols


def _width(t: Tensor, dtype: torch.dtype) -> int:
    return _as_columns(t[:0], dtype).shape[-1]


class RowExchange:
    """Two all-to-alls around a batch function for one megabatch of row-sharded matrices.

    ``counts[s]`` is the number of rows rank s contributes to each matrix of the batch.
    """

    def __init__(self, group: dist.ProcessGroup, counts: Sequence[int], batch: int, stats: CommStats | None):
        self.group, self.stats, self.batch = group, stats, batch
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counts = list(counts)
        chunk = -(-batch // self.world)
        self.owned = [(min(d * chunk, batch), min((d + 1) * chunk, batch)) for d in range(self.world)]

    def _all_to_all(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        if self.stats is not None:
            self.stats.record("all_to_all", send.numel() * send.element_size())
        return recv

    def run(self, fn: Callable[..., Tensor | tuple[Tensor, ...]], *local: Tensor) -> tuple[Tensor, ...]:
        """``local``: this rank's rows, each [B, k_me] or [B, k_me, w]. ``fn`` gets the whole-matrix
        tensors [b_owned, K, ...] and returns tensors of the same shapes and dtypes."""
        dtype = local[0].dtype
        widths = [_width(t, dtype) for t in local]
        width = sum(widths)
        k_me = self.counts[self.rank]
        packed = torch.cat([_as_columns(t, dtype) for t in local], dim=-1)  # [B, k_me, width]
        send_sizes = [(hi - lo) * k_me * width for lo, hi in self.owned]
        lo, hi = self.owned[self.rank]
        mine = hi - lo
        recv_sizes = [mine * c * width for c in self.counts]
        recv = self._all_to_all(packed.reshape(-1), send_sizes, recv_sizes)

        pieces = [p.view(mine, c, width) for p, c in zip(recv.split(recv_sizes), self.counts)]
        whole = torch.cat(pieces, dim=1)  # [mine, K, width]
        if mine:
            inputs = [_from_columns(part, t) for part, t in zip(whole.split(widths, dim=-1), local)]
            out = fn(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            whole = torch.cat([_as_columns(o, dtype) for o in out], dim=-1)

        back_parts = [p.reshape(-1) for p in whole.split(self.counts, dim=1)]
        back = self._all_to_all(torch.cat(back_parts) if back_parts else whole.reshape(-1),
                                recv_sizes, send_sizes)
        result = back.view(self.batch, k_me, width)
        return tuple(_from_columns(part, t) for part, t in zip(result.split(widths, dim=-1), local))
