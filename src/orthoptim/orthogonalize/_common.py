"""Shared handling for the polar iterations: shapes, transposition, working dtype, normalization."""

from __future__ import annotations

import torch
from torch import Tensor


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
    """X / (‖X‖_F + eps) per matrix, computed in fp32 (at least), then cast to the working dtype.

    After this every singular value is <= 1, the interval the polynomials are designed for.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    x32 = x.to(acc)
    norm = torch.linalg.vector_norm(x32, dim=(-2, -1), keepdim=True)
    return (x32 / (norm + eps)).to(dtype)
