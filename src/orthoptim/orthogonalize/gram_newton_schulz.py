"""Gram Newton-Schulz: the Newton-Schulz iteration carried out on the small Gram matrix X Xᵀ.

For X of shape k×n (k ≤ n) standard NS costs ~2k²n + k³ per iteration; here only two k×n
products are paid per restart (R = X Xᵀ at the start, X ← Q X at the end) and every product
inside the loop is k×k and symmetric. The result equals standard NS with the same coefficients
in exact arithmetic, because every iterate X_t = Q_t X_0 with Q_t a polynomial in R_0 = X_0 X_0ᵀ.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.caller_warnings import warn_at_caller
from orthoptim.orthogonalize._common import PolarFactors, as_batch, normalize_gram_, start, working_dtype
from orthoptim.orthogonalize.coefficients import POLAR_EXPRESS, as_coefficients
from orthoptim.orthogonalize.newton_schulz import newton_schulz_factors

# One restart after the second iteration, as published for fp16: the first two Polar Express
# polynomials are steep, and forming Q from them accumulates round-off that a fresh X Xᵀ removes.
DEFAULT_RESTARTS: tuple[int, ...] = (2,)
# Not in bf16. R's small eigenvalues carry an absolute error of about u·λ_max, and the iteration
# R ← P R P carries each eigenvalue's relative error forward (standard NS recomputes X Xᵀ from X
# and only perturbs the polynomial's argument). bf16's u = 2⁻⁸ is enough to push a singular value
# that should peak near 2 between iterations past the edge of the next polynomials' basin, after
# which it grows without bound: even with restarts (2, 4), 0.05-1.7 % of random k×4k matrices,
# k = 2-16, with log-uniform or spiked spectra came out with a largest singular value of 6 to 6e11
# (a plain MLP under Dion3 diverged); fp16 (u = 2⁻¹¹) stayed at or below 1.21 on the same inputs, as
# standard NS does. So by default a bf16 iteration is standard NS; ``restarts=`` given explicitly
# still runs Gram NS in bf16.


def gram_newton_schulz(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    restarts: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
) -> Tensor:
    """Approximate the polar factor of every matrix in ``x`` ([..., k, n]) by Gram Newton-Schulz.

    ``restarts`` lists the iteration indices (0-based) before which X ← Q X and R = X Xᵀ are
    recomputed (default: ``DEFAULT_RESTARTS``). Square matrices gain nothing from the Gram form and
    use standard NS; so does an iteration in bf16 unless ``restarts`` is given (Gram NS is unstable
    in bf16: see ``DEFAULT_RESTARTS``).
    Runs in ``dtype`` (default: fp16 on CUDA; on CPUs bf16 where they multiply it natively, else fp32:
    see ``kernels.cpu_dtype``); returns ``x.dtype``. Not differentiable, like ``newton_schulz``.
    """
    return gram_newton_schulz_factors(x, coefficients, restarts=restarts, dtype=dtype, eps=eps).finish(x)


def gram_newton_schulz_factors(
    x: Tensor,
    coefficients: str | Sequence[Sequence[float]] = POLAR_EXPRESS,
    *,
    restarts: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    eps: float = 1e-7,
) -> PolarFactors:
    """``gram_newton_schulz`` without its last product X ← Q X: returns Q and X (see ``PolarFactors``)."""
    coeffs = as_coefficients(coefficients)
    work = working_dtype(x, dtype, torch.float16)
    standard = restarts is None and work == torch.bfloat16
    restart_at = set(int(i) for i in (DEFAULT_RESTARTS if restarts is None else restarts))
    if any(i < 0 for i in restart_at):
        raise ValueError(f"restarts must be non-negative iteration indices, got {sorted(restart_at)}")
    batch, _ = as_batch(x)
    k, n = batch.shape[-2:]
    if k == n or standard:  # in Gram NS's working dtype (fp16 on CUDA), not standard NS's (bf16 there)
        return newton_schulz_factors(x, coeffs, dtype=work, eps=eps)
    effective = {i for i in restart_at if 0 < i < len(coeffs)}  # before iteration 0, or past the last: no-ops
    if restarts is not None and (work == torch.bfloat16 or (work == torch.float16 and not effective)):
        warn_at_caller(
            f"gram_newton_schulz: restarts={tuple(restarts)} runs Gram Newton-Schulz in {work}, where it can "
            "diverge (largest singular values of 1e10 and NaN on low-rank or spiked inputs; docs/kernels.md, "
            "'The dtype'): in bf16 leave restarts unset (standard NS runs), in fp16 keep at least one "
            "restart, or pass dtype=torch.float32", RuntimeWarning)
    transposed = k > n
    if transposed:
        batch = batch.mT
    X, unnormalized, owned = start(batch, work, eps)
    # Products into buffers that later ones reuse where the torch or blocked backend computes them (on
    # CPUs fresh memory costs page faults; see newton_schulz); the Triton and QuACK kernels return theirs.
    spare = _Buffers(X, X.shape[-2], owned)
    R = kernels.gram(X, out=spare.matrix())
    scale = normalize_gram_(R, eps) if unnormalized else None  # X₀/‖X₀‖ is scale · X
    Q: Tensor | None = None  # None stands for the identity
    last = len(coeffs) - 1
    for i, (a, b, c) in enumerate(coeffs):
        if i in restart_at and Q is not None:
            if scale is not None:
                Q, scale = Q.mul_(scale), None
            X = torch.bmm(Q, X, out=spare.batch(X))
            R = kernels.gram(X, out=spare.matrix(Q))
            Q = None
        P = kernels.symmetric_polynomial(R, a, b, c, out=spare.matrix(R, Q))
        # Q, P and R are polynomials in the R of the last restart: they commute and every product
        # below is symmetric, which lets the kernels compute only half of each.
        Q = P if Q is None else kernels.symmetric_product(Q, P, out=spare.matrix(Q, P, R))
        # R ← P R P, skipped where nothing reads it (last iteration, or a restart comes next).
        if i < last and (i + 1) not in restart_at:
            RP = kernels.symmetric_product(R, P, out=spare.matrix(R, P, Q))
            R = kernels.symmetric_product(P, RP, out=spare.matrix(P, RP, Q))
    assert Q is not None  # coefficient sets are never empty, and each iteration sets Q
    if scale is not None:
        Q = Q.mul_(scale)
    return PolarFactors(Q, X, transposed)


class _Buffers:
    """Reusable outputs for one iteration's products: k×k matrices, and X batches for the restarts.

    ``matrix(*live)`` returns a [B, k, k] buffer that none of the ``live`` tensors occupy (the
    iteration never needs more than four at once); ``batch(x)`` a contiguous one for the X computed
    from ``x``: the first X itself once it has been read, if the iteration ``owns`` it (it is not the
    caller's tensor), else a new one.
    """

    def __init__(self, x: Tensor, k: int, owned: bool):
        self._x = x
        self._shape = (x.shape[0], k, k)
        self._matrices: list[Tensor] = []
        self._batches: list[Tensor] = [x] if owned and x.is_contiguous() else []

    def matrix(self, *live: Tensor | None) -> Tensor:
        taken = {t.data_ptr() for t in live if t is not None}
        for buffer in self._matrices:
            if buffer.data_ptr() not in taken:
                return buffer
        self._matrices.append(self._x.new_empty(self._shape))
        return self._matrices[-1]

    def batch(self, x: Tensor) -> Tensor:
        for buffer in self._batches:
            if buffer.data_ptr() != x.data_ptr():
                return buffer
        self._batches.append(torch.empty(x.shape, dtype=x.dtype, device=x.device))
        return self._batches[-1]
