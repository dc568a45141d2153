"""Momentum accumulation on lists of same-shape tensors (one fused pass each)."""

from __future__ import annotations

import torch
from torch import Tensor


def accumulate_(momenta: list[Tensor], grads: list[Tensor], mu: float) -> None:
    """M ← μ M + G in place (μ = 1 gives the plain sum M ← M + G used by Dion, Dion2 and Dion3)."""
    if mu != 1.0:
        torch._foreach_mul_(momenta, mu)
    torch._foreach_add_(momenta, grads)


def stack_update_input(momenta: list[Tensor], grads: list[Tensor], mu: float, nesterov: bool) -> Tensor:
    """The matrix to orthogonalize, as one batch: M, or G + μ M with Nesterov."""
    if not nesterov:
        return torch.stack(momenta)
    out = torch.empty((len(momenta), *momenta[0].shape), dtype=momenta[0].dtype, device=momenta[0].device)
    for i, (m, g) in enumerate(zip(momenta, grads)):
        torch.add(g, m, alpha=mu, out=out[i])
    return out
