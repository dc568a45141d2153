"""Dion2: orthogonalize only the k = ceil(f·d) slices of the momentum with largest L1 norm.

M ← M + G;  S = top-k slices;  U = M[S];  M[S] ← μ·M[S] (error feedback: what was not applied
stays in momentum, what was applied decays);  X ← X(1 − lr·wd);  X[S] ← X[S] − lr·s(m,n)·orth(U).
Slices are rows when m ≤ n and columns otherwise (the shorter side), so U is as wide as possible.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from orthoptim import kernels
from orthoptim.kernels import torch_backend
from orthoptim.rules import momentum, selection, weight_decay


def dion2_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    *,
    lr: float | Tensor,
    fraction: float,
    mu: float,
    weight_decay_rate: float,
    scale: float,
    orthogonalize: Callable[[Tensor], Tensor],
    dim: int | None = None,
    select: Callable[[list[Tensor]], selection.Index] | None = None,
    stacked: Tensor | None = None,
) -> None:
    """One Dion2 step for a megabatch of same-shape matrices; ``dim`` forces rows (0) or columns (1),
    ``select(M) → index`` replaces the per-matrix top-k (exact selection over a row-sharded matrix).
    ``stacked``: the momenta as the views of one [B, m, n] tensor, for batched slice selection
    (``optim.stacked_state``); the same numbers as the per-matrix ops."""
    rows, cols = momenta[0].shape
    if dim is None:
        dim = 0 if rows <= cols else 1
    k = selection.num_selected(momenta[0].shape[dim], fraction)
    if stacked is not None:
        assert select is None, "stacked state is for this process's own slice selection"
        index = selection.largest(selection.accumulate_and_l1_norms_stacked_(stacked, momenta, grads, dim), k)
        u = selection.gather_stacked(stacked, index, dim)
        selection.decay_stacked_(stacked, index, u, dim, mu)
    else:
        momentum.accumulate_(momenta, grads, 1.0)
        index = selection.top_slices(momenta, k, dim) if select is None else select(momenta)
        u = selection.gather_slices(momenta, index, dim)
        selection.decay_slices_(momenta, index, u, dim, mu)
    o = orthogonalize(u)
    if params[0].dtype in weight_decay.ROUNDED_ONCE:
        # Decay and update of the selected slices in fp32 from the old X, rounded once (Dion3's update
        # without its normalization); columns as the rows of transposed views.
        if dim == 0:
            kernels.dion3_post_update(params, index, o, None, lr=lr, weight_decay=weight_decay_rate, scale=scale,
                                      beta2=0.0, eps=0.0, normalize=False)
        else:  # the Triton kernel is tested on row-major matrices only: the torch one for the views
            torch_backend.dion3_post_update([x.mT for x in params], index, o.mT, None, lr=lr,
                                            weight_decay=weight_decay_rate, scale=scale, beta2=0.0, eps=0.0,
                                            normalize=False)
        return
    weight_decay.decay_(params, lr, weight_decay_rate)
    selection.add_slices_(params, index, o, dim, alpha=-lr * scale)
