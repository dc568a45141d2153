"""Lion for non-matrix parameters: sign of an interpolated momentum."""

from __future__ import annotations

import torch
from torch import Tensor


def lion_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay_rate: float,
) -> None:
    """X ← X(1 − lr·wd) − lr·sign(β₁M + (1−β₁)G);  M ← β₂M + (1−β₂)G."""
    if lr * weight_decay_rate != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay_rate)
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
