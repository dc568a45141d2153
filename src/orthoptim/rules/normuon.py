"""NorMuon: Muon followed by per-neuron (row) normalization of the orthogonalized update."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from orthoptim.rules import momentum, normalization, weight_decay


def normuon_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    variances: list[Tensor],
    *,
    lr: float,
    mu: float,
    nesterov: bool,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
) -> None:
    """One NorMuon step; ``variances`` are the per-row second moments ([m] views)."""
    momentum.accumulate_(momenta, grads, mu)
    o = orthogonalize(momentum.stack_update_input(momenta, grads, mu, nesterov))
    o_hat, v_new = normalization.normalize_rows(o, torch.stack(variances), beta2, eps)
    torch._foreach_copy_(variances, list(v_new.unbind(0)))
    weight_decay.decay_(params, lr, weight_decay_rate)
    weight_decay.apply_(params, o_hat, lr * scale)
