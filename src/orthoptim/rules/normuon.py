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
    lr: float | Tensor,
    mu: float,
    nesterov: bool,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
    finish: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> None:
    """One NorMuon step; ``variances`` are the per-row second moments ([m] views).

    ``finish(B, V) → (Ô, V_new)``: see ``dion3_update``.
    """
    update_input = momentum.accumulate_and_stack(momenta, grads, mu, nesterov)
    if finish is None:  # Ô stays in fp32 (or wider): the update below rounds the parameters once
        o_hat, v_new = normalization.normalize_rows(orthogonalize(update_input), torch.stack(variances), beta2, eps)
    else:
        o_hat, v_new = finish(update_input, torch.stack(variances))
    torch._foreach_copy_(variances, list(v_new.unbind(0)))
    weight_decay.decay_and_apply_(params, o_hat, lr, weight_decay_rate, lr * scale)
