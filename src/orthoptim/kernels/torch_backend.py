"""The reference backend: plain batched matmuls and elementwise torch ops, correct on every device."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

# Dion3's update on CPUs: matrices of up to this many elements are decayed and updated batch-wide
# (larger ones one by one: each matrix's decay, then its rows, while parts of it are still in cache).
CPU_BATCHED_UPDATE_ELEMENTS = 1 << 16


def gram(x: Tensor, out: Tensor | None = None) -> Tensor:
    """X Xᵀ for a batch [B, k, n] → [B, k, k] (symmetric), written into ``out`` when given."""
    return torch.bmm(x, x.mT, out=out)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float, out: Tensor | None = None) -> Tensor:
    """a I + b R + c R² for a batch of symmetric R [B, k, k], written into ``out`` (not ``r``) when given."""
    p = torch.baddbmm(r, r, r, beta=b, alpha=c, out=out)
    if a != 0.0:
        p.diagonal(dim1=-2, dim2=-1).add_(a)
    return p


def symmetric_product(p: Tensor, q: Tensor, out: Tensor | None = None) -> Tensor:
    """P Q for batches of symmetric, commuting P, Q [B, k, k] (so P Q is symmetric), written into ``out``
    (neither ``p`` nor ``q``) when given."""
    return torch.bmm(p, q, out=out)


def row_sums_of_squares(o: Tensor) -> Tensor:
    """Σ_j O² per row of a batch O [..., n] → [...], in O's dtype."""
    # The squared 2-norm: one reduction, where square().sum() writes and reads a copy of O (2-4x the
    # time on CPUs); the two agree to an ulp or so.
    return torch.linalg.vector_norm(o, dim=-1).square()


def normalized_row_scale(sumsq: Tensor, v: Tensor, n: int, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """NorMuon's per-row normalization as one factor per row, from the rows' sums of squares.

    For O [B, k, n] with ``sumsq`` = Σ_j O² [B, k] and variance V [B, k] (same dtype, fp32 or finer):
    V' = β₂V + (1−β₂)·mean_j(O²) and Ô = O/(√V' + ε) rescaled per matrix to ‖Ô‖_F = ‖O‖_F, i.e.
    Ô = c · O row by row. Returns (c [B, k], V').
    """
    v_new = torch.lerp(sumsq / max(n, 1), v, beta2)  # β₂V + (1−β₂)·mean(O²)
    d = v_new.sqrt() + eps
    norm_o = sumsq.sum(-1, keepdim=True).sqrt()
    # Divided twice rather than by d²: with a tiny ε (1e-23) a zero row's d² underflows to 0, and 0/0
    # would be NaN in every row of the matrix after the rescale; (0/d)/d is 0.
    norm_hat = (sumsq / d / d).sum(-1, keepdim=True).sqrt()
    # ‖O‖/‖Ô‖; Ô = 0 only when O = 0, where the clamp keeps 0/0 at 0. A zero row's factor is 0: with
    # ε ≲ 1e-41 ratio/ε overflows, and 0·inf would be NaN.
    scale = norm_o / norm_hat.clamp_min(torch.finfo(sumsq.dtype).tiny) / d
    return torch.where(sumsq > 0, scale, 0.0), v_new


def dion3_post_update(
    params: Tensor | Sequence[Tensor],
    index: Tensor | Sequence[Tensor],
    o: Tensor,
    v: Tensor | None,
    *,
    lr: float | Tensor,
    weight_decay: float,
    scale: float,
    beta2: float,
    eps: float,
    normalize: bool = True,
) -> Tensor | None:
    """Dion3's update after orthogonalization, rounding each parameter element once.

    For each matrix X [m, n] (``params``: [B, m, n] or B same-shape matrices, updated in place),
    its selected rows S = ``index[b]`` (distinct), their orthogonalized rows O = ``o[b]`` [k, n] and
    their variance V = ``v[b]`` [k]:
    V' = β₂V + (1−β₂)·mean_j(O²); Ô = O/(√V' + ε) rescaled to ‖O‖_F (NorMuon, in fp32 or finer);
    X ← X(1 − lr·wd) on every row and X[S] ← X[S](1 − lr·wd) − lr·scale·Ô. Parameters narrower
    than fp32 have their selected rows computed from the old X[S] in fp32 and rounded to X's dtype
    once; fp32 (fp64) ones are decayed, then added to, in their own dtype.
    With ``normalize=False``, Ô = O and V is neither read nor updated.
    ``index`` may also be a list of B 1-D tensors of different lengths (ragged selection); ``o`` and
    ``v`` are then zero-padded to the longest, and the padding is never written.
    Returns V' [B, k] in V's dtype (``None`` with ``normalize=False``).
    """
    xs = list(params.unbind(0)) if isinstance(params, Tensor) else list(params)
    if not xs:
        return v.clone() if normalize else None
    work = torch.promote_types(torch.promote_types(xs[0].dtype, o.dtype), torch.float32)
    if normalize:
        work = torch.promote_types(work, v.dtype)
    o_w = o.to(work)
    sumsq = row_sums_of_squares(o_w)  # [B, k]
    v_new = None
    if isinstance(lr, Tensor):  # capturable: read on the device, no host sync
        step = (lr * -scale).to(device=o.device, dtype=work).expand(len(xs), o.shape[1])
    else:
        step = torch.full((len(xs), o.shape[1]), -lr * scale, dtype=work, device=o.device)
    if normalize:
        row_scale, v_new = normalized_row_scale(sumsq, v.to(work), o.shape[-1], beta2, eps)
        step = step * row_scale
    decay = 1.0 - lr * weight_decay
    if isinstance(index, Tensor) and xs[0].dtype == work and (
            o.device.type != "cpu" or xs[0].numel() <= CPU_BATCHED_UPDATE_ELEMENTS):
        # Small matrices (on CPUs; any on accelerators): the decay and the scaled rows of the whole
        # batch in one op each (per matrix they cost more in dispatch, or launches, than in
        # arithmetic); the rows are added matrix by matrix.
        if weight_decay != 0.0:
            torch._foreach_mul_(xs, decay)
        for x, i, rows in zip(xs, index, o_w * step.unsqueeze(-1)):
            x.index_add_(0, i, rows)
        return v_new.to(v.dtype) if v_new is not None else None
    for x, i, o_b, c_b in zip(xs, index, o_w, step):
        o_b, c_b = o_b[: len(i)], c_b[: len(i)].unsqueeze(-1)  # ragged: each matrix its own number of rows
        if x.dtype == work:
            # X holds the work dtype: decay every row in place and add the scaled rows, as any
            # decay-then-update step rounds (no copy of the old rows to compute from).
            if weight_decay != 0.0:
                x.mul_(decay)
            x.index_add_(0, i, o_b * c_b)
            continue
        rows = torch.addcmul(x.index_select(0, i).to(work) * decay, c_b, o_b)  # from the old X, rounded once
        if weight_decay != 0.0:
            x.mul_(decay)
        x.index_copy_(0, i, rows.to(x.dtype))
    return v_new.to(v.dtype) if v_new is not None else None
