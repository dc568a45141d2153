"""Shared handling for the polar iterations: shapes, transposition, working dtype, normalization."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from orthoptim.kernels import cpu_dtype


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
        """The polar factors [B, ...] in the working dtype, in the input's orientation (contiguous)."""
        if self.transposed:
            # (left @ right)ᵀ computed as rightᵀ @ leftᵀ: the same sums, written in the tall layout.
            # A transposed view of left @ right would make every later elementwise pass (the update
            # of the parameters) read it across the grain: 1.6-1.8x slower product + update on CPU.
            return torch.bmm(self.right.mT, self.left.mT)
        return torch.bmm(self.left, self.right)

    def finish(self, x: Tensor) -> Tensor:
        """The product in the shape and dtype of the input ``x`` ([..., k, n])."""
        out = self.product()
        return out.to(x.dtype).reshape(*x.shape[:-2], *out.shape[-2:])


def working_dtype(x: Tensor, dtype: torch.dtype | None, cuda_default: torch.dtype) -> torch.dtype:
    """The dtype the iteration runs in: explicit choice, else half precision on CUDA, on CPUs the
    choice of ``kernels.cpu_dtype`` (bf16 where the CPU has bf16 matrix units, fp32 elsewhere),
    fp32 on other devices. Float64 inputs stay float64 unless a dtype is given.
    """
    if dtype is not None:
        return dtype
    if x.is_cuda:
        return cuda_default
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return x.dtype
    return cpu_dtype.iteration_dtype() if x.device.type == "cpu" else torch.float32


def as_batch(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """View [..., k, n] as [B, k, n]; return the leading shape to restore it."""
    if x.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    lead = tuple(x.shape[:-2])
    return x.reshape(-1, x.shape[-2], x.shape[-1]), lead


def normalize(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """X / (‖X‖_F + eps) per matrix, computed in fp32 (at least) and rounded once to the working dtype.

    After this every singular value is <= 1, the interval the polynomials are designed for. On
    accelerators the quotient is written straight in the working dtype (no fp32 copy of a
    half-precision input); CPUs run a division with an output of another dtype on a slow path
    (1.3x the time of dividing, then rounding), so there the quotient is rounded afterwards.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=acc)
    if x.device.type == "cpu" and dtype != acc:
        return torch.div(x, norm + eps).to(dtype)
    return torch.div(x, norm + eps, out=torch.empty(x.shape, dtype=dtype, device=x.device))
