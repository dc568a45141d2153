"""Shared handling for the polar iterations: shapes, transposition, working dtype, normalization."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class PolarFactors(NamedTuple):
    """A polar iteration's last product left unmultiplied: orth = left @ right, or its transpose.

    ``left`` [B, k, k] and ``right`` [B, k, n] live on the short side (k ≤ n), in the iteration's
    working dtype; ``transposed`` says the input was tall, so its polar factor is (left @ right)ᵀ.
    A caller that adds the polar factor to a matrix can let one GEMM do it
    (``X.addmm_(left, right, beta=..., alpha=...)``) instead of writing the factor out and
    reading it back.
    """

    left: Tensor
    right: Tensor
    transposed: bool

    def product(self) -> Tensor:
        """The polar factors [B, ...] in the working dtype, in the input's orientation."""
        out = torch.bmm(self.left, self.right)
        return out.mT if self.transposed else out

    def finish(self, x: Tensor) -> Tensor:
        """The product in the shape and dtype of the input ``x`` ([..., k, n])."""
        out = self.product()
        return out.to(x.dtype).reshape(*x.shape[:-2], *out.shape[-2:])


def working_dtype(x: Tensor, dtype: torch.dtype | None, cuda_default: torch.dtype) -> torch.dtype:
    """The dtype the iteration runs in: explicit choice, else half precision on CUDA, fp32 elsewhere.

    CPUs have no fast half-precision matmul, and fp32 costs nothing extra there.
    """
    if dtype is not None:
        return dtype
    if x.is_cuda:
        return cuda_default
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16, torch.float32) else x.dtype


def as_batch(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """View [..., k, n] as [B, k, n]; return the leading shape to restore it."""
    if x.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-2])
    return x.reshape(-1, x.shape[-2], x.shape[-1]), lead


def normalize(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """X / (‖X‖_F + eps) per matrix, computed in fp32 (at least) and rounded once to the working dtype.

    After this every singular value is <= 1, the interval the polynomials are designed for. The
    quotient is written straight in the working dtype: no fp32 copy of a half-precision input.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=acc)
    return torch.div(x, norm + eps, out=torch.empty(x.shape, dtype=dtype, device=x.device))
