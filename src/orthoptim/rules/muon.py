"""Muon: orthogonalized momentum.  M ← μM + G;  B = G + μM (Nesterov) or M;  X ← X − lr·s·orth(B)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

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
) -> None:
    """One Muon step for a megabatch of same-shape matrices (lists of [m, n] views)."""
    momentum.accumulate_(momenta, grads, mu)
    update = orthogonalize(momentum.stack_update_input(momenta, grads, mu, nesterov))
    weight_decay.decay_(params, lr, weight_decay_rate)
    weight_decay.apply_(params, update, lr * scale)
