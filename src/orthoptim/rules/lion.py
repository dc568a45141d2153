"""Lion for non-matrix parameters: sign of an interpolated momentum."""

from __future__ import annotations

import torch
from torch import Tensor

from orthoptim.rules import weight_decay
from orthoptim.rules.momentum import HALF


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
    """X ← X(1 − lr·wd) − lr·sign(β₁M + (1−β₁)G);  M ← β₂M + (1−β₂)G."""
    weight_decay.decay_(params, lr, weight_decay_rate)
    direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_sign_(direction)
    if isinstance(lr, Tensor):
        torch._foreach_mul_(direction, -lr)
        torch._foreach_add_(params, direction)
    elif params and params[0].device.type == "cpu" and params[0].dtype in HALF:
        # CPU ops round a number ``alpha`` to bf16/fp16 first (lr off by up to 2⁻⁹ of itself): add
        # in fp32 and round once.
        for x, d in zip(params, direction):
            x.copy_(torch.add(x.float(), d, alpha=-lr))
    else:
        torch._foreach_add_(params, direction, alpha=-lr)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
