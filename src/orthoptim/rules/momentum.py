"""Momentum accumulation on lists of same-shape tensors (one fused pass each)."""

from __future__ import annotations

import torch
from torch import Tensor


def accumulate_(momenta: list[Tensor], grads: list[Tensor], mu: float) -> None:
    """M ← μ M + G in place (μ = 1 gives the plain sum M ← M + G used by Dion, Dion2 and Dion3)."""
    if mu != 1.0:
        torch._foreach_mul_(momenta, mu)
    torch._foreach_add_(momenta, grads)


def accumulate_and_stack(momenta: list[Tensor], grads: list[Tensor], mu: float, nesterov: bool) -> Tensor:
    """M ← μ M + G in place, and the matrix to orthogonalize as one batch: M, or G + μ M with Nesterov.

    Without Nesterov the new M is written once, into the batch, and copied back: 5 passes over
    momentum-sized memory instead of 7 (scale, add, then stack).
    """
    m0 = momenta[0]
    out = torch.empty((len(momenta), *m0.shape), dtype=m0.dtype, device=m0.device)
    if nesterov:
        accumulate_(momenta, grads, mu)
    for i, (m, g) in enumerate(zip(momenta, grads)):
        torch.add(g, m, alpha=mu, out=out[i])
    if not nesterov:
        torch._foreach_copy_(momenta, list(out.unbind(0)))
    return out
