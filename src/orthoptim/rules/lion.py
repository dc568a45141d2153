"""Lion for non-matrix parameters: sign of an interpolated momentum."""

from __future__ import annotations

import torch
from torch import Tensor

from orthoptim.rules import weight_decay


def lion_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    weight_decay_rate: float,
) -> None:
    """X ← X(1 − lr·wd) − lr·sign(β₁M + (1−β₁)G);  M ← β₂M + (1−β₂)G.

    fp16/bf16 parameters: decay and step computed together in fp32 and rounded once, as the matrix
    rules do (rounded on its own, X·(1 − lr·wd) is X again in bf16 whenever lr·wd < 2⁻⁹).
    """
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    if params and params[0].dtype in weight_decay.ROUNDED_ONCE:
        # in fp32, where a number or tensor lr is exact (CPU kernels round one to bf16 first)
        weight_decay.decay_and_apply_rounded_once_(params, direction, lr, weight_decay_rate, lr)
    elif isinstance(lr, Tensor):
        weight_decay.decay_(params, lr, weight_decay_rate)
        torch._foreach_mul_(direction, -lr)
        torch._foreach_add_(params, direction)
    else:
        weight_decay.decay_(params, lr, weight_decay_rate)
        torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
