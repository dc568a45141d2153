"""Dion: low-rank orthonormal updates by amortized power iteration with error feedback.

B = M + G;  P = orth_cols(B Q);  R = Bᵀ P;  M ← B − (1−μ)·P Rᵀ;  Q ← R / ‖R‖_col (a zero column keeps Q's);
X ← X(1 − lr·wd);  X ← X − lr·s(m,n)·P Qᵀ.   Q (n×r) carries over between steps, so one power
iteration per step tracks the top-r singular subspace of the slowly changing momentum.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from orthoptim.orthogonalize import normalize_columns, orthonormalize_columns
from orthoptim.rules import momentum, weight_decay


def low_rank_factors(momenta: list[Tensor], right_factors: list[Tensor], qr_method: str = "cholesky_qr",
                     sync_free: bool = False) -> Tensor:
    """One power-iteration step per matrix: [P; R] stacked along rows, [B, m + n, r].

    P = orth_cols(B Q) (m×r) and R = Bᵀ P (n×r). Returned as one tensor so a distributed plan can
    compute a share of the batch and gather the rest in one collective. ``sync_free``: see
    ``orthonormalize_columns``.
    """
    p = orthonormalize_columns(torch.stack([b @ q for b, q in zip(momenta, right_factors)]), qr_method, sync_free)
    r = torch.stack([b.mT @ pi for b, pi in zip(momenta, p)])
    return torch.cat([p, r], dim=-2)


def dion_update(
    params: list[Tensor],
    grads: list[Tensor],
    momenta: list[Tensor],
    right_factors: list[Tensor],
    *,
    lr: float | Tensor,
    mu: float,
    eps: float,
    weight_decay_rate: float,
    scale: float,
    qr_method: str = "cholesky_qr",
    factors: Callable[[list[Tensor], list[Tensor]], Tensor] | None = None,
    columns: slice = slice(None),
) -> None:
    """One Dion step for a megabatch of same-shape matrices with right factors Q ([n, r] views).

    ``factors`` computes [P; R] (default: ``low_rank_factors`` here; a distributed plan passes its own).
    ``columns``: when the matrices are column blocks of larger ones, which rows of the whole Q (and of
    the whole R that ``factors`` returns) match their columns.
    """
    momentum.accumulate_(momenta, grads, 1.0)  # B = M + G, held in M
    if factors is None:
        factors = partial(low_rank_factors, qr_method=qr_method)
    rows = momenta[0].shape[0]
    pr = factors(momenta, [q[columns] for q in right_factors])
    p, r = pr[:, :rows], pr[:, rows:]
    for b, pi, ri in zip(momenta, p, r):
        b.addmm_(pi, ri[columns].mT, alpha=-(1.0 - mu))  # error feedback: keep what P Rᵀ did not take
    q_new = normalize_columns(r, eps)
    # A zero column of R (all of B zero: a first gradient of zeros, an expert that got no tokens) would
    # become a zero column of Q, and every later B Q would lack that direction: P's column would then be
    # QR's arbitrary completion (e_j), and the next update would hit only the first r rows. Such a
    # column keeps its old Q instead; the update below still uses the zero column (no update there).
    zero = (r == 0).all(dim=-2, keepdim=True)
    torch._foreach_copy_(right_factors, list(torch.where(zero, torch.stack(right_factors), q_new).unbind(0)))
    if isinstance(lr, Tensor) and params[0].dtype in weight_decay.ROUNDED_ONCE:
        # capturable, fp16/bf16: decay and update in fp32 from the old X, rounded once (as addmm_'s beta
        # does below; a separate decay would round X·(1 − lr·wd) back to X for small lr·wd)
        for x, pi, qi in zip(params, p, q_new):
            new = x.float()
            if weight_decay_rate != 0.0:
                new.mul_(1.0 - lr * weight_decay_rate)
            new.addmm_(pi.float() * (-lr * scale), qi[columns].mT.float())
            x.copy_(new)
        return
    if isinstance(lr, Tensor):  # capturable: the tensor lr scales the small P; decay as its own pass
        weight_decay.decay_(params, lr, weight_decay_rate)
        for x, pi, qi in zip(params, p, q_new):
            pi, alpha = weight_decay.scaled(pi.to(x.dtype), -lr * scale)
            x.addmm_(pi, qi[columns].mT.to(x.dtype), alpha=alpha)
        return
    for x, pi, qi in zip(params, p, q_new):  # X ← (1 − lr·wd)·X − lr·s·P Qᵀ in one pass over X
        x.addmm_(pi.to(x.dtype), qi[columns].mT.to(x.dtype), beta=1.0 - lr * weight_decay_rate, alpha=-lr * scale)
