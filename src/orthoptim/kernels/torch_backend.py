"""The reference backend: plain batched matmuls, correct on every device."""

from __future__ import annotations

import torch
from torch import Tensor


def gram(x: Tensor) -> Tensor:
    """X Xᵀ for a batch [B, k, n] → [B, k, k] (symmetric)."""
    return torch.bmm(x, x.mT)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float) -> Tensor:
    """a I + b R + c R² for a batch of symmetric R [B, k, k]."""
    p = torch.baddbmm(r, r, r, beta=b, alpha=c)
    p.diagonal(dim1=-2, dim2=-1).add_(a)
    return p
