"""NorMuon's per-neuron (row) normalization of an orthogonalized update."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from orthoptim.kernels import torch_backend


def normalize_rows(o: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """Per-row second-moment normalization of a batch O [B, k, n], computed in fp32 (fp64 for fp64).

    V ← β₂ V + (1 − β₂)·mean_j(O²) (V is [B, k]); Ô = O / (√V + ε), rescaled per matrix so that
    ‖Ô‖_F = ‖O‖_F: rows that were large on average shrink, small ones grow, total size is kept.
    Returns (Ô, new V).
    """
    work = torch.promote_types(torch.promote_types(o.dtype, v.dtype), torch.float32)
    o_w = o.to(work)
    sumsq = torch_backend.row_sums_of_squares(o_w)
    row_scale, v_new = torch_backend.normalized_row_scale(sumsq, v.to(work), o.shape[-1], beta2, eps)
    return o_w * row_scale.unsqueeze(-1), v_new.to(v.dtype)


def orthogonalize_and_normalize(
    u: Tensor, v: Tensor, *, orthogonalize: Callable[[Tensor], Tensor], beta2: float, eps: float
) -> tuple[Tensor, Tensor]:
    """The middle of NorMuon and Dion3: Ô and the new V for a batch U [B, k, n] with its rows' V [B, k].

    Ô comes back in U's dtype, so that it can run on another rank and travel back in U's buffers
    (``RowShardedPlan.around``): for bf16/fp16 matrices one rounding more than a single process makes,
    which keeps Ô in fp32 and rounds only the parameters.
    """
    o_hat, v_new = normalize_rows(orthogonalize(u), v, beta2, eps)
    return o_hat.to(u.dtype), v_new
