"""Dion3: Dion2's rule on rows with NorMuon's per-neuron normalization on the selected rows.

M ← M + G;  S = top-k rows by L1 norm (k = ceil(f·m));  U = M[S];  M[S] ← μ·M[S];
O = orth(U) (Gram Newton-Schulz by default);  V[S] ← β₂V[S] + (1−β₂)·mean_j(O²), other rows of V
untouched;  Ô = O/(√V[S] + ε) rescaled to ‖O‖_F;  X ← X(1 − lr·wd);  X[S] ← X[S] − lr·s(m,n)·Ô.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from orthoptim.rules import momentum, normalization, selection, weight_decay


def dion3_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    variances: list[Tensor],
    *,
    lr: float,
    fraction: float,
    mu: float,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
    finish: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    select: Callable[[list[Tensor]], selection.Index] | None = None,
) -> None:
    """One Dion3 step for a megabatch of same-shape matrices; ``variances`` are [m] row views.

    ``finish(U, V[S]) → (Ô, V_new)`` defaults to orthogonalize-then-normalize on this process; a
    distributed plan passes one that runs it where the whole rows are. ``select(M) → index``
    replaces the per-matrix top-k (exact selection over a row-sharded matrix).
    """
    momentum.accumulate_(momenta, grads, 1.0)
    if select is None:
        index = selection.top_slices(momenta, selection.num_selected(momenta[0].shape[0], fraction), 0)
    else:
        index = select(momenta)
    u = selection.gather_slices(momenta, index, 0)
    selection.scatter_slices_(momenta, index, u * mu, 0)
    if finish is None:
        finish = partial(normalization.orthogonalize_and_normalize, orthogonalize=orthogonalize, beta2=beta2, eps=eps)
    o_hat, v_new = finish(u, selection.gather_entries(variances, index))
    selection.scatter_entries_(variances, index, v_new)
    weight_decay.decay_(params, lr, weight_decay_rate)
    selection.add_slices_(params, index, o_hat, 0, alpha=-lr * scale)
