"""Standard Newton-Schulz polar iteration on batches of matrices."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.kernels import torch_backend
from orthoptim.orthogonalize._common import PolarFactors, as_batch, normalize, working_dtype
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
    transposed). Runs in ``dtype`` (default: bf16 on CUDA; on CPUs bf16 where they
    multiply it natively, else fp32: see ``kernels.cpu_dtype``); returns ``x.dtype``.
    ``symmetric_kernels``: compute the two symmetric products (A and bA + cA²) through
    ``orthoptim.kernels`` (lower-triangle Triton kernels on CUDA where they run; the same torch
    products elsewhere), to measure what they buy before the Gram form changes the iteration.
    """
    factors = newton_schulz_factors(x, coefficients, dtype=dtype, eps=eps, symmetric_kernels=symmetric_kernels)
    return factors.finish(x)


def newton_schulz_factors(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    symmetric_kernels: bool = False,
) -> PolarFactors:
    """``newton_schulz`` without its last product: the polar factors are (aI + bA + cA²) X of the
    last iteration, returned as that k×k left factor and X ([B, k, n] batches, see ``PolarFactors``)."""
    coeffs = as_coefficients(coefficients)
    batch, _ = as_batch(x)
    transposed = batch.shape[-2] > batch.shape[-1]
    if transposed:
        batch = batch.mT
    X = normalize(batch, working_dtype(x, dtype, torch.bfloat16), eps)
    if symmetric_kernels:
        for a, b, c in coeffs[:-1]:
            X = torch.baddbmm(X, _polynomial(X, 0.0, b, c), X, beta=a)  # aX + (bA + cA²)X
        a, b, c = coeffs[-1]
        return PolarFactors(_polynomial(X, a, b, c), X, transposed)
    # The torch products write into three buffers that serve every iteration (A, its polynomial,
    # the next X). A fresh tensor per product is free on GPUs, but on CPUs each one is new memory
    # whose page faults cost 10-20% of a bf16 iteration at 512×512 (same numbers either way).
    # X alternates between two buffers, both contiguous: a tall input's X has a transposed layout,
    # and baddbmm into such an output takes a path over 1000x slower on CPUs.
    k = X.shape[-2]
    A = X.new_empty((X.shape[0], k, k))
    P = torch.empty_like(A)
    buffers = (X.new_empty(X.shape), X if X.is_contiguous() else X.new_empty(X.shape))
    for i, (a, b, c) in enumerate(coeffs[:-1]):
        torch_backend.symmetric_polynomial(torch_backend.gram(X, out=A), 0.0, b, c, out=P)
        X = torch.baddbmm(X, P, X, beta=a, out=buffers[i % 2])  # aX + (bA + cA²)X
    a, b, c = coeffs[-1]
    return PolarFactors(torch_backend.symmetric_polynomial(torch_backend.gram(X, out=A), a, b, c, out=P),
                        X, transposed)


def _polynomial(X: Tensor, a: float, b: float, c: float) -> Tensor:
    """aI + bA + cA² with A = X Xᵀ (symmetric), through the kernels' symmetric products."""
    return kernels.symmetric_polynomial(kernels.gram(X), a, b, c)
