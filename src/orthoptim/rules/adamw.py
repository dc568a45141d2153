"""AdamW for non-matrix parameters (biases, norms, embeddings, LM head), foreach over a group."""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
) -> None:
    """One AdamW step (bias-corrected, decoupled weight decay); ``step`` counts from 1."""
    if lr * weight_decay_rate != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay_rate)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias2**0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, value=-lr / bias1)
