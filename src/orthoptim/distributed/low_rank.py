"""Dion's power-iteration step when B is split over ranks: only low-rank factors travel.

- ``rows_group`` (FSDP's outer mesh, or column-parallel TP): P = B Q has the same row split as B.
  Its columns are made orthonormal by Cholesky-QR on the all-reduced r×r Gram matrix PᵀP (twice,
  CholeskyQR2); R = BᵀP is a sum over row shards, one all-reduce of n×r.
- ``cols_group`` (row-parallel TP, or FSDP on dim 1): B Q = Σ_j B_j Q_j over column blocks, one
  all-reduce of m×r; each rank's R_j = B_jᵀ P is its block of R's rows, summed into the whole n×r
  R (zeros elsewhere) so that every rank holds the same R and the same next Q. With both groups
  the matrix is 2-D sharded (outer × inner) and the two sets of reductions compose.
- ``replicate`` (data parallel without gradient sync): every rank holds its own B_i = M_i + G_i.
  Averaging B_i Q and B_iᵀ P over ranks gives exactly the factors of the averaged B, because both
  are linear in B and each rank's error feedback M_i ← B_i − (1−μ) P Rᵀ keeps the mean momentum
  equal to the synchronized one (Dion's compressed data-parallel sync).
Every decision (the Householder fallback) is taken from all-reduced values, so ranks agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.comm import CommStats, all_reduce
from orthoptim.orthogonalize.power_iteration import cholesky_qr_pass


def _householder_rows(p: Tensor, rows_group: dist.ProcessGroup | None, full_rows: int,
                      stats: CommStats | None) -> Tensor:
    """Fallback: gather whole P, Householder QR, keep this rank's rows (rare: ill-conditioned P)."""
    if rows_group is None:
        return torch.linalg.qr(p).Q
    world, rank = dist.get_world_size(rows_group), dist.get_rank(rows_group)
    chunk = -(-full_rows // world)
    padded = p.new_zeros((p.shape[0], chunk, p.shape[2]))
    padded[:, : p.shape[1]] = p
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=rows_group)
    if stats is not None:
        stats.record("all_gather", padded.numel() * padded.element_size())
    sizes = [max(0, min(chunk, full_rows - r * chunk)) for r in range(world)]
    whole = torch.cat([g[:, :s] for g, s in zip(gathered, sizes)], dim=1)
    q = torch.linalg.qr(whole).Q
    return q[:, rank * chunk : rank * chunk + p.shape[1]]


def sharded_low_rank_factors(
    momenta: list[Tensor],
    right_factors: list[Tensor],
    *,
    full_rows: int,
    rows_group: dist.ProcessGroup | None,
    replicate: dist.ProcessGroup | None,
    stats: CommStats | None,
    cols_group: dist.ProcessGroup | None = None,
    full_cols: int | None = None,
    col_offset: int = 0,
    sync_free: bool = False,
) -> Tensor:
    """[P_local; R] stacked along rows, [B, rows_local + n, r]: the distributed ``low_rank_factors``.

    ``momenta`` are this rank's blocks of B, ``right_factors`` the matching row blocks of Q; R comes
    back whole (n = ``full_cols`` rows), identical on every rank. ``sync_free``: the Householder
    fallback is computed every step and chosen per matrix on the device (no host read-back).
    """
    work = momenta[0].dtype if momenta[0].dtype in (torch.float32, torch.float64) else torch.float32
    p = torch.stack([b.to(work) @ q.to(work) for b, q in zip(momenta, right_factors)])
    p = all_reduce(p, cols_group, stats, "sum")
    p = all_reduce(p, replicate, stats, "mean")

    def reduce_gram(gram: Tensor) -> Tensor:
        return all_reduce(gram, rows_group, stats, "sum")

    q1, ok1 = cholesky_qr_pass(p, reduce_gram)
    q2, ok2 = cholesky_qr_pass(torch.nan_to_num(q1), reduce_gram, second=True)
    if sync_free:
        fallback = _householder_rows(p, rows_group, full_rows, stats)
        q2 = torch.where((ok1 & ok2)[:, None, None], q2, fallback)
    elif not bool((ok1 & ok2).all()):
        bad = (~(ok1 & ok2)).nonzero().flatten()
        q2 = q2.clone()
        q2[bad] = _householder_rows(p[bad], rows_group, full_rows, stats)
    r = torch.stack([b.to(work).mT @ pi for b, pi in zip(momenta, q2)])
    r = all_reduce(r, rows_group, stats, "sum")
    if cols_group is not None:
        whole = r.new_zeros((r.shape[0], full_cols, r.shape[2]))
        whole[:, col_offset : col_offset + r.shape[1]] = r
        r = all_reduce(whole, cols_group, stats, "sum")
    r = all_reduce(r, replicate, stats, "mean")
    return torch.cat([q2, r], dim=-2).to(momenta[0].dtype)
