"""Symmetric products on CPUs: only the blocks on and above the diagonal, then mirrored.

The CPU counterpart of ``triton_symmetric``. Each matrix of a batch is cut into row blocks of
``BLOCK`` rows; block row i of a symmetric result C (rows i·s … i·s+s−1) is computed from column
i·s on, by one GEMM per block row, and the blocks below the diagonal are then copied from their
transposes. With T blocks that is T(T+1)/2 of the T² blocks' multiply-adds (0.67 at T = 3, 0.56 at
T = 8), for a few GEMM calls per matrix and one transposed copy of the lower half.

Each block row is a plain GEMM on views (strided rows are BLAS's leading dimension), so every
element is the same sum of products a full GEMM forms, accumulated and rounded as oneDNN/MKL do.
Below ~768 rows the smaller GEMMs run slow enough to lose what they skip (AMD Zen 4, bf16 and
fp32: 0.6-1.4x per product at k = 256-512, losses mostly on two threads; 1.1-1.8x from k = 768 to
2048 on one and two threads; ``benchmarks/cpu_symmetric_bench.py``), which is why ``select`` only
picks them from ``MIN_BLOCKED_SIZE`` on; the exception is X Xᵀ of a wide X, whose block rows are
GEMMs over the long side and win from ``MIN_BLOCKED_WIDE_GRAM_SIZE`` on, in smaller blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows per block: 128 and 256 tie within 4 % on whole Muon and Dion3 steps at k = 768-1024; 512 is slower.
BLOCK = 256


def _block(block: int | None) -> int:
    """The rows per block: ``block`` if given, else the module's ``BLOCK`` (read at each call)."""
    block = BLOCK if block is None else block
    if block < 1:
        raise ValueError(f"block must be a positive number of rows, got {block}")
    return block


def _output(like: Tensor, k: int, out: Tensor | None) -> Tensor:
    shape = (like.shape[0], k, k)
    if out is not None and tuple(out.shape) == shape and out.dtype == like.dtype and out.is_contiguous():
        return out
    return like.new_empty(shape)


def _mirror_upper(c: Tensor, block: int) -> Tensor:
    """Copy each block above the diagonal, transposed, to its place below it."""
    k = c.shape[-1]
    for i in range(0, k - block, block):
        c[:, i + block:, i:i + block] = c[:, i:i + block, i + block:].mT
    return c


def gram(x: Tensor, out: Tensor | None = None, block: int | None = None) -> Tensor:
    """X Xᵀ for a batch [B, k, n] → [B, k, k]: block row i is X[i] X[i:]ᵀ."""
    k, block = x.shape[-2], _block(block)
    c = _output(x, k, out)
    for xb, cb in zip(x, c):
        for i in range(0, k, block):
            torch.mm(xb[i:i + block], xb[i:].T, out=cb[i:i + block, i:])
    return _mirror_upper(c, block)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float, out: Tensor | None = None,
                         block: int | None = None) -> Tensor:
    """a I + b R + c R² for a batch of symmetric R [B, k, k] (``out`` must not be ``r``)."""
    k, block = r.shape[-1], _block(block)
    p = _output(r, k, out)
    for rb, pb in zip(r, p):
        for i in range(0, k, block):
            # R² = R Rᵀ: block row i of R times R's columns from i on.
            torch.addmm(rb[i:i + block, i:], rb[i:i + block], rb[:, i:], beta=b, alpha=c, out=pb[i:i + block, i:])
    if a != 0.0:
        p.diagonal(dim1=-2, dim2=-1).add_(a)
    return _mirror_upper(p, block)


def symmetric_product(p: Tensor, q: Tensor, out: Tensor | None = None, block: int | None = None) -> Tensor:
    """P Q for batches of symmetric, commuting P, Q [B, k, k] (P Q is then symmetric); ``out`` is
    neither ``p`` nor ``q``."""
    k, block = p.shape[-1], _block(block)
    c = _output(p, k, out)
    for pb, qb, cb in zip(p, q, c):
        for i in range(0, k, block):
            torch.mm(pb[i:i + block], qb[:, i:], out=cb[i:i + block, i:])
    return _mirror_upper(c, block)
