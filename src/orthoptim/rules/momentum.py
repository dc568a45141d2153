"""Momentum accumulation on lists of same-shape tensors (one fused pass each)."""

from __future__ import annotations

import torch
from torch import Tensor

# CPU kernels round a Python scalar (``add``'s alpha, a foreach op's scalar) to a bf16/fp16 tensor's
# dtype before using it: bf16's μ = 0.99 would be 0.98828 (1 − μ off by 17 %), and 0.999 would be 1.
HALF = (torch.float16, torch.bfloat16)


def add_scaled(g: Tensor, m: Tensor, mu: float, out: Tensor) -> Tensor:
    """out ← G + μ·M, with μ exact and one rounding to ``out``'s dtype (``out`` may be ``m``)."""
    if g.device.type == "cpu" and torch.promote_types(g.dtype, m.dtype) in HALF and mu != 1.0:
        # In fp32 (where the scalar is exact), then rounded once: matrix-sized fp32 temporaries (M's
        # widening and the sum), one matrix at a time.
        return out.copy_(torch.add(g, m.float(), alpha=mu))
    return torch.add(g, m, alpha=mu, out=out)


def accumulate_(momenta: list[Tensor], grads: list[Tensor], mu: float) -> None:
    """M ← μ M + G in place (μ = 1 gives the plain sum M ← M + G used by Dion, Dion2 and Dion3)."""
    if mu == 1.0:
        torch._foreach_add_(momenta, grads)
        return
    for m, g in zip(momenta, grads):
        add_scaled(g, m, mu, out=m)


def accumulate_and_stack(momenta: list[Tensor], grads: list[Tensor], mu: float, nesterov: bool,
                         dtype: torch.dtype | None = None) -> Tensor:
    """M ← μ M + G in place, and the matrix to orthogonalize as one batch: M, or G + μ M with Nesterov.

    ``dtype``: the batch's (default: the momentum's). A polar iteration that rounds its input to bf16
    first takes it in bf16 directly: half the bytes written, and no full-precision batch to read back.
    Without Nesterov and in the momentum's dtype, the new M is written once, into the batch, and
    copied back; otherwise M ← G + μM is one pass per matrix (a scale, then an add, would be two).
    """
    m0 = momenta[0]
    dtype = m0.dtype if dtype is None else dtype
    out = torch.empty((len(momenta), *m0.shape), dtype=dtype, device=m0.device)
    if not nesterov and dtype == m0.dtype:
        for i, (m, g) in enumerate(zip(momenta, grads)):
            add_scaled(g, m, mu, out=out[i])
        torch._foreach_copy_(momenta, list(out.unbind(0)))
        return out
    for m, g, batch in zip(momenta, grads, out):
        add_scaled(g, m, mu, out=m)
        if nesterov:  # rounded once to ``dtype``
            add_scaled(g, m, mu, out=batch)
        else:
            batch.copy_(m)
    return out
