"""Standard Newton-Schulz polar iteration on batches of matrices."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.orthogonalize._common import as_batch, normalize, working_dtype
from orthoptim.orthogonalize.coefficients import POLAR_EXPRESS, as_coefficients


def newton_schulz(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    symmetric_kernels: bool = False,
) -> Tensor:
    """Approximate the polar factor U Vᵀ of every matrix in ``x`` ([..., k, n]).

    Each iteration is X ← aX + (bA + cA²)X with A = X Xᵀ, on the short side (tall inputs are
    transposed). Runs in ``dtype`` (default: bf16 on CUDA, fp32 otherwise); returns ``x.dtype``.
    ``symmetric_kernels``: compute the two symmetric products (A and bA + cA²) through
    ``orthoptim.kernels`` (lower-triangle Triton kernels on CUDA where they run; the same torch
    products elsewhere), to measure what they buy before the Gram form changes the iteration.
    """
    coeffs = as_coefficients(coefficients)
    batch, lead = as_batch(x)
    transposed = batch.shape[-2] > batch.shape[-1]
    if transposed:
        batch = batch.mT
    X = normalize(batch, working_dtype(x, dtype, torch.bfloat16), eps)
    for a, b, c in coeffs:
        if symmetric_kernels:
            A = kernels.gram(X)
            B = kernels.symmetric_polynomial(A, 0.0, b, c)
        else:
            A = torch.bmm(X, X.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # bA + cA²
        X = torch.baddbmm(X, B, X, beta=a)  # aX + BX
    if transposed:
        X = X.mT
    return X.to(x.dtype).reshape(*lead, *X.shape[-2:])
