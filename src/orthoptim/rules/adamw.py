"""AdamW for non-matrix parameters (biases, norms, embeddings, LM head), foreach over a group."""

from __future__ import annotations

import torch
from torch import Tensor

from orthoptim.rules import weight_decay


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: int | list[Tensor],
    *,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
) -> None:
    """One AdamW step (bias-corrected, decoupled weight decay); ``step`` counts from 1.

    ``step`` is a number, or one 0-dim tensor per parameter (already incremented). With tensors on
    the parameters' device, torch's fused AdamW kernel does the step in one read and write of each
    tensor (7 passes; the foreach sequence below takes 21 and a parameter-sized temporary);
    otherwise, with device tensors (capturable), the bias corrections are computed on the device,
    so the step never reads a value back to the host.
    """
    lists = [params, grads, exp_avgs, exp_avg_sqs]
    if _fused_applies(lists, step):
        # The kernel walks memory linearly: a tensor of another layout (a transposed view, channels_last)
        # steps as a contiguous copy, written back after. (CPU foreach ops, the other way, would round
        # β₂ = 0.999 to 1 for bf16 state.)
        strided = not all(t.is_contiguous() for ts in lists for t in ts)
        dense = [[t.contiguous() for t in ts] for ts in lists] if strided else lists
        torch._fused_adamw_(*dense, [], step, amsgrad=False, lr=lr, beta1=beta1,
                            beta2=beta2, weight_decay=weight_decay_rate, eps=eps, maximize=False)
        if strided:
            for ts, copies in zip((params, exp_avgs, exp_avg_sqs), (dense[0], dense[2], dense[3])):
                for t, c in zip(ts, copies):
                    if c is not t:
                        t.copy_(c)
        return
    if isinstance(step, list) and all(s.device.type == "cpu" for s in step) and not isinstance(lr, Tensor):
        # Host step counts (reading them costs no sync): bias corrections as float64 numbers, one per
        # parameter (a parameter without a gradient on some steps has a count of its own), as
        # torch.optim.AdamW computes them; fp32 tensors lost 1 − β₂ᵗ to cancellation (7e-6 of the update).
        step = [int(s) for s in step]
    weight_decay.decay_(params, lr, weight_decay_rate)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    if not isinstance(lr, Tensor) and (isinstance(step, int) or all(isinstance(t, int) for t in step)):
        counts = [step] * len(params) if isinstance(step, int) else step
        torch._foreach_div_(denom, [(1.0 - beta2**t) ** 0.5 for t in counts])
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denom, [-lr / (1.0 - beta1**t) for t in counts])
        return
    steps = step if isinstance(step, list) else [torch.tensor(float(step), dtype=torch.float32, device=p.device)
                                                 for p in params]
    # Stored in fp32 (torch's fused kernel takes that); the corrections in the parameters' precision
    # where it is wider: in fp32, β₂ = 0.999 is off by 1.3e-8, which is 1.3e-5 of 1 − β₂.
    steps = [s.to(torch.promote_types(s.dtype, x.dtype)) for s, x in zip(steps, params)]
    # X ← X + m / d with d = (√v/√b₂ + ε)·(−b₁/lr): the step size folded into the denominator.
    bias1 = torch._foreach_pow(beta1, steps)
    torch._foreach_sub_(bias1, 1.0)  # −b₁ = β₁ᵗ − 1
    bias2_sqrt = torch._foreach_pow(beta2, steps)
    torch._foreach_neg_(bias2_sqrt)
    torch._foreach_add_(bias2_sqrt, 1.0)
    torch._foreach_sqrt_(bias2_sqrt)
    torch._foreach_div_(denom, bias2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_mul_(denom, bias1)
    torch._foreach_div_(denom, lr)
    torch._foreach_addcdiv_(params, exp_avgs, denom)


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _fused_applies(lists: list[list[Tensor]], step: int | list[Tensor]) -> bool:
    """torch's fused AdamW (torch >= 2.4 on CPU) takes step tensors on the parameters' device."""
    params = lists[0]
    if not hasattr(torch, "_fused_adamw_") or not isinstance(step, list) or not params:
        return False
    device, dtype = params[0].device, params[0].dtype
    return (device.type in ("cpu", "cuda") and dtype in _FUSED_DTYPES
            and all(t.device == device and t.dtype == dtype for ts in lists for t in ts)
            and all(s.device == device and s.dtype == torch.float32 for s in step))

