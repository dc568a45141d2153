"""The exact polar factor by SVD: the reference the iterations are tested against."""

from __future__ import annotations

import torch
from torch import Tensor


def svd_polar(x: Tensor) -> Tensor:
    """U Vᵀ of every matrix in ``x`` ([..., k, n]) over its nonzero singular values, computed in
    float64; returns ``x.dtype``.

    Singular values at round-off level (≤ max(k, n)·ε·σ_max) count as zero: their singular
    vectors are an arbitrary basis of the null space, and Newton-Schulz maps them to 0 too. So a
    zero matrix gives 0, not an arbitrary orthogonal matrix, and an input of exact rank r a rank-r
    factor. The input's values are taken as exact: a rank-r product rounded to fp32 or bf16 is in
    general of full rank, and its singular values at that rounding's level (above the float64 cutoff)
    become 1, where Newton-Schulz, which cannot lift values that small in five steps, leaves them near 0.
    Exact but slow: use it as ``orthogonalizer=svd_polar`` in tests, or as a quality reference.
    """
    u, s, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
    tol = max(x.shape[-2:], default=1) * torch.finfo(torch.float64).eps * s[..., :1]
    keep = (s > tol).to(torch.float64)
    return ((u * keep.unsqueeze(-2)) @ vh).to(x.dtype)
