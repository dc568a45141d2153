"""Decoupled weight decay and the scaled update of whole matrices.

Learning rates may be Python numbers or 0-dim tensors (a captured CUDA graph reads a tensor's value
at replay, so an LR schedule that fills it in place keeps working); no function here syncs with the
device on a tensor learning rate.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orthoptim.orthogonalize import PolarFactors
from orthoptim.rules.momentum import HALF

LearningRate = float | Tensor
# On CPUs, fp32-or-wider parameters take their decay and update one block of this many elements at a
# time (256 KiB of fp32), the block still in cache for the second op: 2.5 passes over memory instead of
# the 4.5 of a decay pass and an update pass, and the update's widening to the parameters' dtype works
# in a small scratch instead of a fresh matrix-sized one (whose page faults cost more than the add).
# 2^15-2^17 tie within noise on a 2-core Xeon (AMX); 0 turns the blocking off.
CPU_BLOCK_ELEMENTS = 1 << 16
# On GPUs, fuse the last product into the update only from this many multiply-adds per matrix
# (512³): below it, launch overhead outweighs the saved passes. A first guess, not yet measured.
FUSED_MIN_MACS_ON_ACCELERATORS = 1 << 27


def decay_(params: list[Tensor], lr: LearningRate, weight_decay: float) -> None:
    """X ← X · (1 − lr·wd) for every tensor (skipped when it is a no-op)."""
    # A tensor lr is not compared with 0 on the host (that would read it back).
    if weight_decay == 0.0 or (not isinstance(lr, Tensor) and lr == 0.0):
        return
    factor = 1.0 - lr * weight_decay
    if not isinstance(factor, Tensor) and params and params[0].device.type == "cpu" and params[0].dtype in HALF:
        # CPU foreach ops round a number to bf16/fp16 first (1 − 0.0021 becomes 1 − 2⁻⁸, 1.9x the
        # decay); a tensor's own mul_ keeps it exact, as torch.optim.AdamW's single-tensor step does.
        for x in params:
            x.mul_(factor)
        return
    torch._foreach_mul_(params, factor)


def apply_(params: list[Tensor], updates: Tensor, step_size: LearningRate) -> None:
    """X ← X − step_size · U for each matrix X and the matching matrix of the batch U."""
    if isinstance(step_size, Tensor):
        # A tensor cannot be an ``alpha``: scale the (temporary) update batch instead.
        updates = updates.to(params[0].dtype) * -step_size  # a 0-dim fp32 factor, kept in the parameters' dtype
        torch._foreach_add_(params, list(updates.unbind(0)))
        return
    wider = torch.promote_types(updates.dtype, params[0].dtype) != params[0].dtype
    if wider or updates.device.type != "cpu":
        # A wider update is rounded once, to the parameters' dtype. On accelerators the multi-tensor
        # kernel needs one dtype in both lists (mixed lists launch one add per matrix): convert first.
        updates = updates.to(params[0].dtype)
    # On CPUs a narrower update (a bf16 iteration's, fp32 parameters) is widened exactly inside the
    # add, which converts one matrix at a time: no fp32 copy of the whole batch at once.
    torch._foreach_add_(params, list(updates.unbind(0)), alpha=-step_size)


# Parameter dtypes whose decay and update are computed together in fp32 and rounded once: rounded
# on its own, X·(1 − lr·wd) is X again in bf16 whenever lr·wd < 2⁻⁹, and decoupled weight decay
# would have no effect at all.
ROUNDED_ONCE = HALF


def decay_and_apply_(params: list[Tensor], updates: Tensor, lr: LearningRate, weight_decay: float,
                     step_size: LearningRate) -> None:
    """X ← X·(1 − lr·wd) − step_size·U for each matrix X and the matching matrix of the batch U.

    fp32 and wider parameters: ``decay_`` then ``apply_``, each rounding in the parameters' dtype.
    fp16/bf16 ones: computed in fp32 from the old X, one matrix at a time, and rounded once.
    """
    if params[0].dtype not in ROUNDED_ONCE:
        if _blocked_on_cpu(params, updates, lr, step_size):
            _decay_and_apply_blocks_(params, updates, 1.0 - lr * weight_decay, step_size)
            return
        decay_(params, lr, weight_decay)
        apply_(params, updates, step_size)
        return
    decay_and_apply_rounded_once_(params, list(updates.unbind(0)), lr, weight_decay, step_size)


def decay_and_apply_rounded_once_(params: list[Tensor], updates: list[Tensor], lr: LearningRate,
                                  weight_decay: float, step_size: LearningRate) -> None:
    """X ← X·(1 − lr·wd) − step_size·U computed in fp32 from the old X, one tensor at a time, and
    rounded once to X's dtype (``ROUNDED_ONCE``); ``updates`` pair with ``params`` (any shapes)."""
    decay = 1.0 - lr * weight_decay  # a number, or a 0-dim tensor (no host read)
    for x, u in zip(params, updates):
        new = x.float()
        if weight_decay != 0.0:
            new.mul_(decay)
        if isinstance(step_size, Tensor):
            new.addcmul_(u, -step_size)
        else:
            new.add_(u, alpha=-step_size)
        x.copy_(new)


def _blocked_on_cpu(params: list[Tensor], updates: Tensor, lr: LearningRate, step_size: LearningRate) -> bool:
    return (CPU_BLOCK_ELEMENTS > 0 and updates.device.type == "cpu" and not isinstance(lr, Tensor)
            and not isinstance(step_size, Tensor) and updates.is_contiguous()
            and torch.promote_types(updates.dtype, params[0].dtype) == params[0].dtype
            and all(x.is_contiguous() and x.shape == updates.shape[1:] for x in params))


def _decay_and_apply_blocks_(params: list[Tensor], updates: Tensor, decay: float, step_size: float) -> None:
    """X ← X·decay − step_size·U, block by block (``CPU_BLOCK_ELEMENTS``): the same two roundings per
    element as the decay pass and the update pass, in the same order."""
    block = CPU_BLOCK_ELEMENTS
    for x, u in zip(params, updates.unbind(0)):
        xf, uf = x.view(-1), u.view(-1)
        for i in range(0, xf.numel(), block):
            xb = xf[i:i + block]
            if decay != 1.0:
                xb.mul_(decay)
            xb.add_(uf[i:i + block], alpha=-step_size)


def apply_polar_factors_(params: list[Tensor], factors: PolarFactors, lr: LearningRate, weight_decay: float,
                         scale: float) -> None:
    """X ← X·(1 − lr·wd) − lr·scale·(left @ right) for each matrix, the product written by the GEMM that
    reads and writes X: decay, update and the polar iteration's last product in one pass over X.

    Falls back to ``decay_and_apply_`` when the iteration ran in another dtype than the parameters
    (one rounding of the update to the parameter dtype, as there), on accelerators for small
    matrices, where one kernel launch per matrix costs more than the passes it saves, and for fp16/bf16
    parameters with a tensor lr (whose decay could not be folded into the GEMM's ``beta``).
    """
    left, right = factors.left, factors.right
    k, n = right.shape[-2:]
    narrow_tensor_lr = isinstance(lr, Tensor) and params[0].dtype in ROUNDED_ONCE
    if left.dtype != params[0].dtype or narrow_tensor_lr or \
            (left.device.type != "cpu" and k * k * n < FUSED_MIN_MACS_ON_ACCELERATORS):
        decay_and_apply_(params, factors.product(), lr, weight_decay, lr * scale)
        return
    if isinstance(lr, Tensor):  # addmm's beta and alpha must be numbers: scale the k×k factor instead
        decay_(params, lr, weight_decay)
        left, beta, alpha = left * (-lr * scale), 1.0, 1.0
    else:
        beta, alpha = 1.0 - lr * weight_decay, -lr * scale
    for x, a, b in zip(params, left, right):
        # Tall matrices were orthogonalized transposed: Xᵀ ← β Xᵀ + α a b.
        (x.mT if factors.transposed else x).addmm_(a, b, beta=beta, alpha=alpha)


def scaled(t: Tensor, alpha: LearningRate) -> tuple[Tensor, float]:
    """(t', a) with t'·a = t·alpha and ``a`` a number, for ops whose ``alpha`` must be one."""
    if isinstance(alpha, Tensor):
        return t * alpha, 1.0
    return t, alpha
