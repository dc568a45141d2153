"""Decoupled weight decay and the scaled update of whole matrices.

Learning rates may be Python numbers or 0-dim tensors (a captured CUDA graph reads a tensor's value
at replay, so an LR schedule that fills it in place keeps working); no function here syncs with the
device on a tensor learning rate.
"""

from __future__ import annotations

import torch
from torch import Tensor

LearningRate = float | Tensor


def decay_(params: list[Tensor], lr: LearningRate, weight_decay: float) -> None:
    """X ← X · (1 − lr·wd) for every tensor (skipped when it is a no-op)."""
    # A tensor lr is not compared with 0 on the host (that would read it back).
    if weight_decay != 0.0 and (isinstance(lr, Tensor) or lr != 0.0):
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)


def apply_(params: list[Tensor], updates: Tensor, step_size: LearningRate) -> None:
    """X ← X − step_size · U for each matrix X and the matching matrix of the batch U."""
    updates = updates.to(params[0].dtype)
    if isinstance(step_size, Tensor):
        # A tensor cannot be an ``alpha``: scale the (temporary) update batch instead.
        updates = updates * -step_size  # a 0-dim fp32 factor: computed in fp32, kept in the update's dtype
        torch._foreach_add_(params, list(updates.unbind(0)))
    else:
        torch._foreach_add_(params, list(updates.unbind(0)), alpha=-step_size)


def scaled(t: Tensor, alpha: LearningRate) -> tuple[Tensor, float]:
    """(t', a) with t'·a = t·alpha and ``a`` a number, for ops whose ``alpha`` must be one."""
    if isinstance(alpha, Tensor):
        return t * alpha, 1.0
    return t, alpha
