"""Slice selection for Dion2 / Dion3: pick the k rows (or columns) of largest L1 norm."""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from itertools import repeat

import torch
from torch import Tensor

from orthoptim.rules.momentum import HALF


def ceil_fraction(fraction: float, size: int) -> int:
    """ceil(fraction · size): the fewest k slices whose share k / size (as a float) reaches ``fraction``.

    Float products round: 0.3 · 20 is 6.000000000000001, whose ceiling 7 is one slice too many, and
    the float 5/6 is a hair above five sixths, so 5/6 · 6 would be 6. Subtracting a tolerance instead
    made 0.1250000001 · 8 one slice too few. Comparing shares as floats gives 6, 5 and 2.
    """
    return _ceil_fraction(float(fraction), int(size))


@functools.lru_cache(maxsize=4096)
def _ceil_fraction(fraction: float, size: int) -> int:
    k = math.ceil(Fraction(fraction) * size)  # exact: the fewest k with k / size ≥ fraction in real numbers
    # k − 1 slices may already reach the fraction once their share is rounded to a float (5/6 · 6).
    return k - 1 if k > 0 and (k - 1) / size >= fraction else k


def num_selected(size: int, fraction: float) -> int:
    """k = ceil(fraction · size): at least 1, except 0 for an empty (shard of a) matrix."""
    return max(1, ceil_fraction(fraction, size)) if size > 0 else 0


# On CPUs |M| is formed this many elements at a time (256 KiB of fp32), in one scratch that stays in
# cache: a whole-matrix |M| costs two more passes over memory and a fresh allocation per matrix,
# whose page faults made this the costliest elementwise op of a Dion3 step. (A fused
# vector_norm(ord=1) is several times slower than abs + sum on CPUs; on GPUs it is one kernel.)
L1_CHUNK_ELEMENTS = 1 << 16


def l1_norms(momenta: list[Tensor], dim: int, add: list[Tensor] | None = None) -> Tensor:
    """[B, size] L1 norms of the slices along ``dim`` (0: rows, 1: columns) of same-shape matrices,
    accumulated in fp32 or wider. ``add``: first M ← M + add in place; on CPUs block by block, each
    block summed and measured while it is in cache (one pass over M instead of two)."""
    m0 = momenta[0]
    acc = torch.promote_types(m0.dtype, torch.float32)
    if m0.device.type != "cpu":
        if add is not None:
            torch._foreach_add_(momenta, add)
        return torch.stack([torch.linalg.vector_norm(m, 1, dim=1 - dim, dtype=acc) for m in momenta])
    rows, cols = m0.shape
    step = max(1, L1_CHUNK_ELEMENTS // max(cols, 1))
    scratch = torch.empty((min(step, rows), cols), dtype=m0.dtype, device=m0.device)
    norms = torch.zeros((len(momenta), rows if dim == 0 else cols), dtype=acc, device=m0.device)
    for m, g, out in zip(momenta, add if add is not None else repeat(None), norms):
        grad_blocks = g.split(step) if g is not None else repeat(None)
        for block, grad, rows_out in zip(m.split(step), grad_blocks, out.split(step) if dim == 0 else repeat(out)):
            if grad is not None:
                block.add_(grad)
            part = torch.abs(block, out=scratch[: len(block)])
            if dim == 0:  # whole rows per block: each row is summed in one piece
                torch.sum(part, dim=1, dtype=acc, out=rows_out)
            else:
                out += part.sum(dim=0, dtype=acc)
    return norms


def accumulate_and_row_norms_(momenta: list[Tensor], grads: list[Tensor]) -> Tensor:
    """M ← M + G in place and the [B, m] L1 norms of the new rows, as ``l1_norms(momenta, 0)`` after
    ``momentum.accumulate_(momenta, grads, 1.0)`` gives them, bit for bit, in one pass over M on CPUs
    (~12 % less time than the two passes at 512-wide matrices)."""
    return l1_norms(momenta, 0, add=grads)


def largest(norms: Tensor, k: int) -> Tensor:
    """Indices [B, k] of the k largest of each matrix's slice norms ``norms`` [B, size], unsorted."""
    return torch.topk(norms, k, dim=-1, sorted=False).indices


def top_slices(momenta: list[Tensor], k: int, dim: int) -> Tensor:
    """Indices [B, k] of the k slices along ``dim`` (0: rows, 1: columns) with largest L1 norm."""
    return largest(l1_norms(momenta, dim), k)


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


def decay_slices_(targets: list[Tensor], index: Index, current: Tensor, dim: int, mu: float) -> None:
    """targets[i][S_i] ← μ · targets[i][S_i], given ``current`` = the gathered slices (``gather_slices``).

    Written as one in-place add of (μ − 1)·current: no scaled copy of the batch is allocated. For
    bf16/fp16 momenta, whose ``index_add_`` rounds a number ``alpha`` to their dtype (on CPUs; on CUDA
    too, as its kernel reads it; 1 − μ off by up to 2⁻⁹), μ·current computed in fp32 and rounded
    once instead (a copy of the selected slices).
    """
    if _half(targets[0]):
        for i, t in enumerate(targets):
            rows = current[i].narrow(dim, 0, len(index[i]))
            t.index_copy_(dim, index[i], (rows.float() * mu).to(t.dtype))
        return
    add_slices_(targets, index, current, dim, alpha=mu - 1.0)


def _half(t: Tensor) -> bool:
    return t.dtype in HALF


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


# --------------------------------------------------------------------- batched, on stacked momenta
# When a megabatch's momenta are the views of one [B, m, n] tensor (``optim.stacked_state``), these do
# once for the batch what the per-matrix ops above do, with the same arithmetic and row reductions.


def accumulate_and_l1_norms_stacked_(stack: Tensor, momenta: list[Tensor], grads: list[Tensor], dim: int) -> Tensor:
    """M ← M + G in place and the [B, size] L1 norms of the new slices along ``dim`` (0: rows, 1: columns),
    for momenta that are the views ``stack`` [B, m, n]."""
    torch._foreach_add_(momenta, grads)
    acc = torch.promote_types(stack.dtype, torch.float32)
    reduced = -1 if dim == 0 else -2
    if stack.device.type != "cpu":
        return torch.linalg.vector_norm(stack, 1, dim=reduced, dtype=acc)
    # As ``l1_norms`` sums a block holding a whole (contiguous, ≤ L1_CHUNK_ELEMENTS) matrix, with |M|
    # formed a few matrices at a time in one small scratch.
    batch, rows, cols = stack.shape
    step = max(1, L1_CHUNK_ELEMENTS // max(rows * cols, 1))
    scratch = torch.empty((min(step, batch), rows, cols), dtype=stack.dtype, device=stack.device)
    norms = torch.empty((batch, rows if dim == 0 else cols), dtype=acc, device=stack.device)
    for start in range(0, batch, step):
        part = torch.abs(stack[start : start + step], out=scratch[: min(step, batch - start)])
        torch.sum(part, dim=reduced, dtype=acc, out=norms[start : start + step])
    return norms


def _expanded(stack: Tensor, index: Tensor, dim: int) -> Tensor:
    """``index`` [B, k] spread over the other axis of ``stack`` [B, m, n], for gather / scatter."""
    if dim == 0:
        return index[:, :, None].expand(-1, -1, stack.shape[-1])
    return index[:, None, :].expand(-1, stack.shape[1], -1)


def gather_stacked(stack: Tensor, index: Tensor, dim: int) -> Tensor:
    """``gather_slices`` of the views of ``stack``: [B, k, n] for rows, [B, m, k] for columns."""
    return torch.gather(stack, dim + 1, _expanded(stack, index, dim))


def decay_stacked_(stack: Tensor, index: Tensor, current: Tensor, dim: int, mu: float) -> None:
    """``decay_slices_`` of the views of ``stack``. Rows of a contiguous stack: one ``index_add_`` over
    the rows of all matrices, the per-matrix op's arithmetic (its fused scale rounds otherwise than a
    scaled copy would); columns, matrix by matrix."""
    if dim == 0 and stack.is_contiguous():
        batch, rows, cols = stack.shape
        flat = (index + torch.arange(batch, device=index.device)[:, None] * rows).flatten()
        if _half(stack):  # as decay_slices_: μ·current in fp32, rounded once
            stack.view(batch * rows, cols).index_copy_(0, flat, (current.flatten(0, 1).float() * mu).to(stack.dtype))
        else:
            stack.view(batch * rows, cols).index_add_(0, flat, current.flatten(0, 1), alpha=mu - 1.0)
    else:
        decay_slices_(list(stack.unbind(0)), index, current, dim, mu)
