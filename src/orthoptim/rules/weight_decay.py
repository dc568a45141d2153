"""Decoupled weight decay and the scaled update of whole matrices."""

from __future__ import annotations

import torch
from torch import Tensor


def decay_(params: list[Tensor], lr: float, weight_decay: float) -> None:
    """X ← X · (1 − lr·wd) for every tensor (skipped when it is a no-op)."""
    if lr * weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)


def apply_(params: list[Tensor], updates: Tensor, step_size: float) -> None:
    """X ← X − step_size · U for each matrix X and the matching matrix of the batch U."""
    torch._foreach_add_(params, list(updates.to(params[0].dtype).unbind(0)), alpha=-step_size)
