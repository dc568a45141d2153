"""Dion3: Dion2's rule on rows with NorMuon's per-neuron normalization on the selected rows.

M ← M + G;  S = top-k rows by L1 norm (k = ceil(f·m));  U = M[S];  M[S] ← μ·M[S];
O = orth(U) (Gram Newton-Schulz by default);  V[S] ← β₂V[S] + (1−β₂)·mean_j(O²), other rows of V
untouched;  Ô = O/(√V[S] + ε) rescaled to ‖O‖_F;  X ← X(1 − lr·wd);  X[S] ← X[S] − lr·s(m,n)·Ô.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from orthoptim import kernels
from orthoptim.rules import momentum, selection


def dion3_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    variances: list[Tensor],
    *,
    lr: float | Tensor,
    fraction: float,
    mu: float,
    beta2: float,
    eps: float,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
    finish: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    select: Callable[[list[Tensor]], selection.Index] | None = None,
    stacked: tuple[Tensor, Tensor] | None = None,
) -> None:
    """One Dion3 step for a megabatch of same-shape matrices; ``variances`` are [m] row views.

    ``finish(U, V[S]) → (Ô, V_new)`` defaults to orthogonalize-then-normalize on this process; a
    distributed plan passes one that runs it where the whole rows are. ``select(M) → index``
    replaces the per-matrix top-k (exact selection over a row-sharded matrix). ``stacked``: the
    momenta and variances as the views of one [B, m, n] and one [B, m] tensor, for batched row
    selection (``optim.stacked_state``); the same numbers as the per-matrix ops.
    """
    if stacked is not None:
        assert select is None, "stacked state is for this process's own row selection"
        m_stack, v_stack = stacked
        norms = selection.accumulate_and_l1_norms_stacked_(m_stack, momenta, grads, 0)
        index = selection.largest(norms, selection.num_selected(momenta[0].shape[0], fraction))
        u = selection.gather_stacked(m_stack, index, 0)
        selection.decay_stacked_(m_stack, index, u, 0, mu)
        v_selected = torch.gather(v_stack, 1, index)
    else:
        if select is None:  # M ← M + G with the rows' L1 norms in the same pass
            norms = selection.accumulate_and_row_norms_(momenta, grads)
            index = selection.largest(norms, selection.num_selected(momenta[0].shape[0], fraction))
        else:
            momentum.accumulate_(momenta, grads, 1.0)
            index = select(momenta)
        u = selection.gather_slices(momenta, index, 0)
        selection.decay_slices_(momenta, index, u, 0, mu)
        v_selected = selection.gather_entries(variances, index)
    post = partial(kernels.dion3_post_update, lr=lr, weight_decay=weight_decay_rate, scale=scale, beta2=beta2, eps=eps)
    if finish is None:  # normalize, decay and update in one pass, one rounding of the parameters
        v_new = post(params, index, orthogonalize(u), v_selected)
    else:  # Ô and V' were computed where the whole rows are
        o_hat, v_new = finish(u, v_selected)
        post(params, index, o_hat, None, normalize=False)
    if stacked is not None:
        v_stack.scatter_(1, index, v_new.to(v_stack.dtype))
    else:
        selection.scatter_entries_(variances, index, v_new)
