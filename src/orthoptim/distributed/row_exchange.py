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
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.comm import CommStats, all_gather_batch
from orthoptim.distributed.dtensor import shard_rows
from orthoptim.rules.selection import l1_norms, num_selected


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
    if cols.dtype != like.dtype and cols.element_size() > like.element_size():
        cols = cols.to(like.dtype)
    elif cols.dtype != like.dtype:
        # Always a fresh copy (these are a few values per row): a slice of the packed rows can count as
        # contiguous and still start mid-element of ``like``'s dtype, or carry odd strides on its size-1
        # dims (one row of an odd width), and view() refuses both.
        cols = torch.empty(cols.shape, dtype=cols.dtype, device=cols.device).copy_(cols).view(like.dtype)
    return cols.squeeze(-1) if like.ndim == 2 else cols


def _width(t: Tensor, dtype: torch.dtype) -> int:
    return _as_columns(t[:0], dtype).shape[-1]


class RowExchange:
    """Two all-to-alls around a batch function for one megabatch of row-sharded matrices.

    ``counts[s]`` is the number of rows rank s contributes to each matrix of the batch: one int for
    all matrices, or a list with one entry per matrix (exact global selection). Every matrix must
    total the same number of rows K, so the owner runs ``fn`` on one [b_owned, K, ...] batch.
    """

    def __init__(self, group: dist.ProcessGroup, counts: Sequence[int | Sequence[int]], batch: int,
                 stats: CommStats | None):
        self.group, self.stats, self.batch = group, stats, batch
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.counts = [[int(c)] * batch if isinstance(c, int) else [int(x) for x in c] for c in counts]
        totals = {sum(self.counts[s][j] for s in range(self.world)) for j in range(batch)}
        if len(totals) > 1:
            raise ValueError(f"matrices of one batch must total the same rows, got {sorted(totals)}")
        chunk = -(-batch // self.world)
        self.owned = [range(min(d * chunk, batch), min((d + 1) * chunk, batch)) for d in range(self.world)]

    def _all_to_all(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        recv = send.new_empty(sum(recv_sizes))
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        if self.stats is not None:
            self.stats.record("all_to_all", send.numel() * send.element_size())
        return recv

    def run(self, fn: Callable[..., Tensor | tuple[Tensor, ...]], *local: Tensor) -> tuple[Tensor, ...]:
        """``local``: this rank's rows, each [B, k_me] or [B, k_me, w] (padded beyond this rank's count
        for a matrix). ``fn`` gets whole-matrix tensors [b_owned, K, ...] and returns tensors of the
        same shapes and dtypes; the result comes back shaped like ``local`` (padding left as zeros)."""
        dtype = local[0].dtype
        widths = [_width(t, dtype) for t in local]
        width = sum(widths)
        mine_rows = self.counts[self.rank]
        packed = torch.cat([_as_columns(t, dtype) for t in local], dim=-1)  # [B, k_me, width]
        send_parts = [packed[j, : mine_rows[j]].reshape(-1) for d in range(self.world) for j in self.owned[d]]
        send_sizes = [sum(mine_rows[j] for j in self.owned[d]) * width for d in range(self.world)]
        mine = self.owned[self.rank]
        recv_sizes = [sum(self.counts[s][j] for j in mine) * width for s in range(self.world)]
        recv = self._all_to_all(_cat(send_parts, packed), send_sizes, recv_sizes)

        # Owner: matrix j's rows arrive from every source in rank order.
        per_source = [chunk.split([self.counts[s][j] * width for j in mine])
                      for s, chunk in enumerate(recv.split(recv_sizes))]
        rows_total = sum(self.counts[s][mine[0]] for s in range(self.world)) if len(mine) else 0
        whole = packed.new_empty((len(mine), rows_total, width))
        for jj, j in enumerate(mine):
            whole[jj] = torch.cat([per_source[s][jj].view(self.counts[s][j], width) for s in range(self.world)])
        if len(mine):
            inputs = [_from_columns(part, t) for part, t in zip(whole.split(widths, dim=-1), local)]
            out = fn(*inputs)
            out = out if isinstance(out, tuple) else (out,)
            whole = torch.cat([_as_columns(o, dtype) for o in out], dim=-1)

        back_parts = []
        for s in range(self.world):
            for jj, j in enumerate(mine):
                start = sum(self.counts[t][j] for t in range(s))
                back_parts.append(whole[jj, start : start + self.counts[s][j]].reshape(-1))
        back = self._all_to_all(_cat(back_parts, packed), recv_sizes, send_sizes)

        result = torch.zeros_like(packed)
        offset = 0
        for d in range(self.world):
            for j in self.owned[d]:
                n = mine_rows[j] * width
                result[j, : mine_rows[j]] = back[offset : offset + n].view(mine_rows[j], width)
                offset += n
        return tuple(_from_columns(part, t) for part, t in zip(result.split(widths, dim=-1), local))


def _cat(parts: list[Tensor], like: Tensor) -> Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


class GlobalRowSelection:
    """Exact top-k rows by L1 norm of row-sharded matrices, the same rows one process would pick.

    One all-gather of every row's L1 norm; each rank then runs the same top-k on the whole norm
    vector and keeps the winners it holds. ``counts`` (rows per rank per matrix) feeds RowExchange.
    """

    def __init__(self, group: dist.ProcessGroup, full_rows: int, k: int, stats: CommStats | None):
        self.group, self.full_rows, self.k, self.stats = group, full_rows, k, stats
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.rows = shard_rows(full_rows, self.world)
        self.counts: list[list[int]] = []

    def __call__(self, momenta: list[Tensor]) -> list[Tensor]:
        chunk = -(-self.full_rows // self.world)
        local = torch.zeros((1, len(momenta), chunk), dtype=torch.float32, device=momenta[0].device)
        local[0, :, : momenta[0].shape[0]] = l1_norms(momenta, 0)  # same-shape shards of one megabatch
        gathered = all_gather_batch(local, self.group, self.stats)  # [world, B, chunk]
        norms = torch.cat([gathered[s, :, : self.rows[s]] for s in range(self.world)], dim=1)
        top = torch.topk(norms, self.k, dim=-1).indices  # [B, k], identical on every rank
        starts = [sum(self.rows[:s]) for s in range(self.world)]
        owner = torch.bucketize(top, torch.tensor(starts[1:], device=top.device), right=True)
        self.counts = [(owner == s).sum(-1).tolist() for s in range(self.world)]
        mine = owner == self.rank
        return [row[keep] - starts[self.rank] for row, keep in zip(top, mine)]


class RowShardedPlan:
    """The communication around one megabatch of row-sharded matrices: which rows each rank sends
    (all, per-shard top-k, or exact global top-k) and the two all-to-alls around the middle step."""

    def __init__(self, group: dist.ProcessGroup, rows: int, batch: int, stats: CommStats | None):
        self.group, self.rows, self.batch, self.stats = group, rows, batch, stats
        self.counts: Callable[[], list] = lambda: shard_rows(rows, dist.get_world_size(group))

    def select_rows(self, fraction: float, scope: str) -> Callable[[list[Tensor]], Any] | None:
        """Per-shard top-k needs no hook (the rule's own top-k on local rows); global selection does."""
        if scope == "global":
            selector = GlobalRowSelection(self.group, self.rows, num_selected(self.rows, fraction), self.stats)
            self.counts = lambda: selector.counts
            return selector
        per_shard = [num_selected(c, fraction) for c in shard_rows(self.rows, dist.get_world_size(self.group))]
        self.counts = lambda: per_shard
        return None

    def around(self, fn: Callable[..., Any]) -> Callable[..., tuple[Tensor, ...]]:
        """``fn`` run on whole rows at the owner ranks, called with and returning this rank's rows."""
        return lambda *local: RowExchange(self.group, self.counts(), self.batch, self.stats).run(fn, *local)
