"""Shared handling for the polar iterations: shapes, transposition, working dtype, normalization."""

from __future__ import annotations

import math
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
    """The dtype the iteration runs in: explicit choice; else float64 for float64 inputs on every
    device (fp64 parameters are chosen for precision, which a half-precision iteration would undo);
    else half precision on CUDA, on CPUs the choice of ``kernels.cpu_dtype`` (bf16 where the CPU has
    bf16 matrix units, fp32 elsewhere), fp32 on other devices.
    """
    if dtype is not None:
        return dtype
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return x.dtype
    if x.is_cuda:
        return cuda_default
    return cpu_dtype.iteration_dtype() if x.device.type == "cpu" else torch.float32


def as_batch(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """View [..., k, n] as [B, k, n]; return the leading shape to restore it.

    The polar iterations write into reused buffers (``out=``), which autograd cannot follow: an input
    that requires grad, with grad mode on, is refused by name here rather than deep inside a product.
    """
    if x.ndim < 2:
        raise ValueError(f"orthogonalization needs a matrix or a batch of matrices, got shape {tuple(x.shape)}")
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError("the Newton-Schulz iterations are not differentiable (they reuse buffers in place); "
                         "call them under torch.no_grad() or on x.detach(), or use svd_polar for gradients")
    lead = tuple(x.shape[:-2])
    # math.prod, not -1: a batch of k×0 or 0×n matrices has no elements to infer B from.
    return x.reshape(math.prod(lead), x.shape[-2], x.shape[-1]), lead


# Working dtypes with fp32's exponent range or more. In them X Xᵀ of X as given (not yet divided by its
# norm) overflows only where ‖X‖_F² itself would, so the division can wait for the first Gram
# matrix (``start``); in fp16, X Xᵀ would overflow from entries of a few hundred on.
WIDE_RANGE = (torch.bfloat16, torch.float32, torch.float64)


def start(x: Tensor, dtype: torch.dtype, eps: float) -> tuple[Tensor, bool, bool]:
    """An iteration's first X in the working dtype: (X, whether it is still to be normalized, whether
    it is a fresh tensor the iteration may overwrite).

    In wide-range dtypes (from inputs no wider than them) X is only rounded: ‖X‖_F² is the trace of
    the first X Xᵀ, which the iteration computes anyway, so ``normalize_gram_`` divides there, on k×k
    numbers. That spares the passes of ``normalize`` over the k×n batch (a norm, a quotient and its
    rounding: on CPUs 20-30 % of a bf16 iteration on 128×512 matrices) and, for an input already in
    the working dtype, any copy at all.
    """
    # A float64 input iterated in a narrower dtype is normalized in float64: its ‖X‖_F² may not fit.
    if dtype in WIDE_RANGE and (x.dtype != torch.float64 or dtype == torch.float64):
        rounded = x.to(dtype)
        return rounded, True, rounded is not x
    return normalize(x, dtype, eps), False, True


def normalize_gram_(a: Tensor, eps: float) -> Tensor:
    """For A = X Xᵀ of an unnormalized X (``start``): A ← A/(‖X‖_F + eps)² in place, and the factor
    s = 1/(‖X‖_F + eps) [B, 1, 1] (in A's dtype) that the first k×k factor multiplying X must carry.

    ‖X‖_F² is A's trace, summed in fp32 or wider; in bf16 it is then within ~2⁻⁸ of the exact norm,
    well inside the 5 % the Polar Express safety factor allows. Where it overflows (‖X‖_F ≳ 1.8e19
    in fp32, bf16) s is 0 and A is zeroed, so the polar factor is 0, as a quotient by an infinite
    norm gives.
    """
    acc = torch.promote_types(a.dtype, torch.float32)
    norm = a.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=acc).sqrt()[:, None, None]
    scale = torch.where(torch.isfinite(norm), 1.0 / (norm + eps), 0.0).to(a.dtype)
    # s in A's dtype, the factor X is given later (a bf16 one is within 2⁻⁹ of the exact s). A takes
    # that same s squared in fp32 (exact for a bf16 s), so it is the Gram matrix of s·X up to one
    # rounding of its entries: a separately rounded s² would differ by up to 2⁻⁷ in bf16, which the
    # steep first polynomial magnifies (3x the distance to U Vᵀ for some input scales).
    square = scale.to(acc).square()
    if a.dtype == acc:
        a.mul_(square)
    else:  # on CPUs a bf16 tensor times an fp32 one in place takes a slow path (~20x this)
        a.copy_(a.to(acc).mul_(square))
    a.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # inf · 0 where the norm overflowed
    return scale


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
