"""Muon: orthogonalized momentum.  M ← μM + G;  B = G + μM (Nesterov) or M;  X ← X − lr·s·orth(B)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from orthoptim.orthogonalize import PolarFactors
from orthoptim.rules import momentum, weight_decay


def muon_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float | Tensor,
    mu: float,
    nesterov: bool,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
    factors: Callable[[Tensor], PolarFactors] | None = None,
    stack_dtype: torch.dtype | None = None,
) -> None:
    """One Muon step for a megabatch of same-shape matrices (lists of [m, n] views).

    ``factors``: the same orthogonalizer in factored form (``orthoptim.orthogonalize.PolarFactors``),
    when the parameters are at hand: its last product then lands in the parameters directly.
    ``stack_dtype``: the dtype of the batch handed to the orthogonalizer (default: the momentum's),
    e.g. the one a polar iteration rounds its input to anyway (``orthogonalize.input_dtype``).
    """
    update_input = momentum.accumulate_and_stack(momenta, grads, mu, nesterov, stack_dtype)
    if factors is not None:
        weight_decay.apply_polar_factors_(params, factors(update_input), lr, weight_decay_rate, scale)
        return
    update = orthogonalize(update_input)
    weight_decay.decay_and_apply_(params, update, lr, weight_decay_rate, lr * scale)
