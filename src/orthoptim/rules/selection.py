"""Slice selection for Dion2 / Dion3: pick the k rows (or columns) of largest L1 norm."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def num_selected(size: int, fraction: float) -> int:
    """k = ceil(fraction · size): at least 1, except 0 for an empty (shard of a) matrix."""
    return max(1, math.ceil(fraction * size - 1e-9)) if size > 0 else 0


def top_slices(momenta: list[Tensor], k: int, dim: int) -> Tensor:
    """Indices [B, k] of the k slices along ``dim`` (0: rows, 1: columns) with largest L1 norm."""
    # abs().sum() rather than vector_norm(ord=1): same numbers, several times faster on CPU.
    norms = torch.stack([m.abs().sum(dim=1 - dim) for m in momenta])
    return torch.topk(norms, k, dim=-1, sorted=False).indices


# An index is a [B, k] tensor, or a list of B 1-D tensors of different lengths when each matrix keeps
# a different number of slices (a row shard under exact global selection). Ragged batches are
# zero-padded to the longest; the padding is never written back.
Index = Tensor | list[Tensor]


def _width(index: Index) -> int:
    return index.shape[-1] if isinstance(index, Tensor) else max((len(i) for i in index), default=0)


def gather_slices(momenta: list[Tensor], index: Index, dim: int) -> Tensor:
    """The selected slices as one batch: [B, k, n] for rows, [B, m, k] for columns."""
    m0 = momenta[0]
    shape = list(m0.shape)
    shape[dim] = _width(index)
    if isinstance(index, Tensor):
        out = torch.empty((len(momenta), *shape), dtype=m0.dtype, device=m0.device)
        for i, m in enumerate(momenta):
            torch.index_select(m, dim, index[i], out=out[i])
        return out
    out = torch.zeros((len(momenta), *shape), dtype=m0.dtype, device=m0.device)
    for i, m in enumerate(momenta):
        out[i].narrow(dim, 0, len(index[i])).copy_(m.index_select(dim, index[i]))
    return out


def scatter_slices_(targets: list[Tensor], index: Index, values: Tensor, dim: int) -> None:
    """targets[i][S_i] ← values[i] along ``dim``."""
    for i, t in enumerate(targets):
        t.index_copy_(dim, index[i], values[i].narrow(dim, 0, len(index[i])).to(t.dtype))


def add_slices_(targets: list[Tensor], index: Index, values: Tensor, dim: int, alpha: float | Tensor) -> None:
    """targets[i][S_i] ← targets[i][S_i] + alpha · values[i] along ``dim`` (alpha: a number or 0-dim tensor)."""
    if isinstance(alpha, Tensor):
        values, alpha = values * alpha, 1.0
    for i, t in enumerate(targets):
        t.index_add_(dim, index[i], values[i].narrow(dim, 0, len(index[i])).to(t.dtype), alpha=alpha)


def gather_entries(vectors: list[Tensor], index: Index) -> Tensor:
    """Per-row state of the selected rows, [B, k] (zero-padded when ragged)."""
    if isinstance(index, Tensor):
        return torch.stack([v[i] for v, i in zip(vectors, index)])
    out = vectors[0].new_zeros((len(vectors), _width(index)))
    for row, v, i in zip(out, vectors, index):
        row[: len(i)] = v[i]
    return out


def scatter_entries_(vectors: list[Tensor], index: Index, values: Tensor) -> None:
    """vectors[i][S_i] ← values[i]."""
    for v, i, new in zip(vectors, index, values):
        v.index_copy_(0, i, new[: len(i)].to(v.dtype))
