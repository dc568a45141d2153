"""Dion's amortized power iteration: orthonormal columns by (Cholesky-)QR, one step per optimizer step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# Cholesky-QR loses orthogonality like κ(P)²·u (u = unit round-off). Above this bound on κ²·u we
# no longer trust even the second Cholesky-QR pass and use Householder QR instead.
CHOLESKY_QR_MAX_ERROR = 1e-2
# The second pass starts from the first one's Q₁: it makes Q₁ orthonormal to round-off only when
# ‖Q₁ᵀQ₁ − I‖ < 1 (then κ(Q₁)² ≤ (1 + δ)/(1 − δ)). Checked directly, on the Gram matrix the pass
# forms anyway, because the Cholesky diagonal's spread only bounds κ(P) from below: for some
# matrices (Kahan's, rotated) it stays small while κ(P)²·u ≫ 1 and Q₁ is far from orthonormal.
CHOLESKY_QR2_MAX_DEVIATION = 0.5


def cholesky_qr_pass(p: Tensor, reduce_gram: Callable[[Tensor], Tensor] | None = None,
                     second: bool = False) -> tuple[Tensor, Tensor]:
    """One Cholesky-QR pass: P L⁻ᵀ with L Lᵀ = Pᵀ P. Returns (Q, ok) where ok flags trusted matrices.

    ``reduce_gram`` turns the local Pᵀ P into the whole one when P's rows are spread over ranks.
    ``second``: P is the first pass's Q, trusted only if ‖PᵀP − I‖_F < ``CHOLESKY_QR2_MAX_DEVIATION``.
    """
    gram = torch.bmm(p.mT, p)
    if reduce_gram is not None:
        gram = reduce_gram(gram)
    L, info = torch.linalg.cholesky_ex(gram)
    diag = L.diagonal(dim1=-2, dim2=-1)
    # The Cholesky diagonal bounds the spread of singular values; its ratio squared estimates κ².
    cond_sq = (diag.amax(-1) / diag.amin(-1).clamp_min(torch.finfo(p.dtype).tiny)) ** 2
    ok = (info == 0) & torch.isfinite(diag).all(-1) & (cond_sq * torch.finfo(p.dtype).eps < CHOLESKY_QR_MAX_ERROR)
    if second:
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        ok &= torch.linalg.matrix_norm(gram - eye) < CHOLESKY_QR2_MAX_DEVIATION
    q = torch.linalg.solve_triangular(L.mT, p, upper=True, left=False)
    return q, ok


def orthonormalize_columns(p: Tensor, method: str = "cholesky_qr", sync_free: bool = False) -> Tensor:
    """Orthonormal basis of the column space of every matrix in ``p`` ([B, m, r], r ≤ m).

    ``"cholesky_qr"`` (default): two Cholesky-QR passes (CholeskyQR2: two r×r Cholesky solves,
    much cheaper than Householder on tall matrices), with Householder QR for every matrix whose
    Cholesky factor is not finite or too ill-conditioned. ``"qr"``: Householder QR always.
    ``sync_free``: pick the fallback per matrix on the device (Householder QR is then computed for
    every matrix) instead of reading the verdict back to the host: for captured CUDA graphs.
    """
    if method not in ("cholesky_qr", "qr"):
        raise ValueError(f"method={method!r} is not supported; use 'cholesky_qr' or 'qr'")
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    if method == "qr":
        return torch.linalg.qr(work).Q.to(p.dtype)
    q, ok = cholesky_qr_pass(work)
    q2, ok2 = cholesky_qr_pass(torch.nan_to_num(q), second=True)
    ok = ok & ok2 & torch.isfinite(q2).flatten(1).all(-1)
    if sync_free:
        return torch.where(ok[:, None, None], q2, torch.linalg.qr(work).Q).to(p.dtype)
    if not bool(ok.all()):
        bad = (~ok).nonzero().flatten()
        q2 = q2.clone()
        q2[bad] = torch.linalg.qr(work[bad]).Q
    return q2.to(p.dtype)


def power_iteration(b: Tensor, q: Tensor, method: str = "cholesky_qr") -> tuple[Tensor, Tensor]:
    """One step of amortized power iteration for B [Bt, m, n] with right factor Q [Bt, n, r].

    Returns P = orth_cols(B Q) [Bt, m, r] and R = Bᵀ P [Bt, n, r]: two matmuls with B.
    """
    p = orthonormalize_columns(torch.bmm(b, q), method)
    r = torch.bmm(b.mT, p)
    return p, r


def normalize_columns(r: Tensor, eps: float) -> Tensor:
    """R / ‖R‖ per column (ε-guarded), the next step's right factor Q, in R's dtype.

    Computed in fp32 at least: in fp16 an ε of 1e-8 rounds to 0, and a zero column (a zero
    gradient, or B of rank below r) would turn into 0/0 = NaN.
    """
    acc = torch.promote_types(r.dtype, torch.float32)
    norms = torch.linalg.vector_norm(r, dim=-2, keepdim=True, dtype=acc)
    return (r.to(acc) / (norms + eps)).to(r.dtype)
