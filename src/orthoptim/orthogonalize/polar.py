"""The exact polar factor by SVD: the reference the iterations are tested against."""

from __future__ import annotations

import torch
from torch import Tensor


def svd_polar(x: Tensor) -> Tensor:
    """U Vᵀ of every matrix in ``x`` ([..., k, n]), computed in float64; returns ``x.dtype``.

    Exact but slow: use it as ``orthogonalizer=svd_polar`` in tests, or as a quality reference.
    """
    u, _, vh = torch.linalg.svd(x.to(torch.float64), full_matrices=False)
    return (u @ vh).to(x.dtype)
