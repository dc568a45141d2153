"""Standard Newton-Schulz polar iteration on batches of matrices."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.kernels import torch_backend
from orthoptim.orthogonalize._common import PolarFactors, as_batch, normalize_gram_, start, working_dtype
from orthoptim.orthogonalize.coefficients import POLAR_EXPRESS, as_coefficients


def newton_schulz(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    symmetric_kernels: bool | None = None,
) -> Tensor:
    """Approximate the polar factor U Vᵀ of every matrix in ``x`` ([..., k, n]).

    Each iteration is X ← (aI + bA + cA²)X with A = X Xᵀ, on the short side (tall inputs are
    transposed): one product, the aX term folded into the k×k factor. (As aX + (bA + cA²)X, a
    baddbmm first copies X into its output: 2-26 % of a bf16 CPU iteration. In bf16, on Gaussian
    matrices, the folded form's distance to U Vᵀ is within 0.0004 of the unfolded one's with Polar
    Express coefficients at 32-64 rows and 0.004-0.007 smaller from 128 rows; with Keller Jordan's it
    is 0.007-0.009 larger at 32-64 rows, 0.009 smaller at 256.) Runs in ``dtype`` (default: bf16 on CUDA;
    on CPUs bf16 where they multiply it natively, else fp32: see ``kernels.cpu_dtype``); returns
    ``x.dtype``.
    Not differentiable (buffers are reused in place): call it under ``torch.no_grad()``, as the
    optimizers do; ``svd_polar`` is the differentiable reference.
    ``symmetric_kernels``: compute the two symmetric products (A and bA + cA²) through
    ``orthoptim.kernels``, which pick per product: half-computed blocked products on CPUs from
    ``kernels.MIN_BLOCKED_SIZE`` rows on, lower-triangle Triton kernels on CUDA where they run, plain
    batched products elsewhere. ``False``: plain batched products everywhere. ``None`` (default):
    the kernels on CPUs, where the blocked products were measured to win, and plain products on
    accelerators until the Triton crossover for this iteration is measured (the ladder's
    ``muon+sym`` rung measures it).
    """
    factors = newton_schulz_factors(x, coefficients, dtype=dtype, eps=eps, symmetric_kernels=symmetric_kernels)
    return factors.finish(x)


def newton_schulz_factors(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
    symmetric_kernels: bool | None = None,
) -> PolarFactors:
    """``newton_schulz`` without its last product: the polar factors are (aI + bA + cA²) X of the
    last iteration, returned as that k×k left factor and X ([B, k, n] batches, see ``PolarFactors``)."""
    coeffs = as_coefficients(coefficients)
    batch, _ = as_batch(x)
    transposed = batch.shape[-2] > batch.shape[-1]
    if transposed:
        batch = batch.mT
    X, unnormalized, owned = start(batch, working_dtype(x, dtype, torch.bfloat16), eps)
    # The products write into buffers that serve every iteration: A and its polynomial P (torch and
    # blocked backends), and two for X. A fresh tensor per product is free on GPUs, but on CPUs each one is
    # new memory whose page faults cost 10-20 % of a bf16 iteration at 512×512. Both X buffers are
    # contiguous: a tall input's first X may have a transposed layout, and a CPU product written
    # into such an output runs over 1000x slower. The caller's tensor is never written.
    if symmetric_kernels is None:
        symmetric_kernels = X.device.type == "cpu"
    products = kernels if symmetric_kernels else torch_backend
    k = X.shape[-2]
    A = P = None
    if products is torch_backend or kernels.backend(X, size=k) in ("torch", "blocked"):
        A = X.new_empty((X.shape[0], k, k))
        P = torch.empty_like(A)
    buffers = (X.new_empty(X.shape), X if owned and X.is_contiguous() else X.new_empty(X.shape))
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        A = products.gram(X, out=A)
        scale = normalize_gram_(A, eps) if unnormalized and i == 0 else None
        P = products.symmetric_polynomial(A, a, b, c, out=P)
        if scale is not None:  # P · X₀/‖X₀‖ = (P/‖X₀‖) · X₀
            P.mul_(scale)
        if i < last:
            X = torch.bmm(P, X, out=buffers[i % 2])
    return PolarFactors(P, X, transposed)
