"""Dion's power-iteration step: orthonormal columns by (Cholesky-)QR, and its convergence.

References are computed here in float64 with torch.linalg.svd / torch.linalg.qr.
"""

from __future__ import annotations

import math

import pytest
import torch

import orthoptim
from orthoptim.orthogonalize import normalize_columns, orthonormalize_columns, power_iteration
from orthoptim.orthogonalize.power_iteration import cholesky_qr_pass

# ---------------------------------------------------------------------------------------------
# Error bounds (measured on the inputs of this file before being fixed here).

# ‖QᵀQ − I‖_max and per-column ‖(I − QQᵀ)p_j‖ / ‖p_j‖: measured ≤ 9.5e-7 / 8.3e-7 in fp32 and
# ≤ 2.2e-15 / 2.6e-15 in fp64 (both methods, up to 512×64), including the fallback cases.
ORTHO_TOL = {torch.float32: 5e-6, torch.float64: 1e-13}
SPAN_TOL = {torch.float32: 5e-6, torch.float64: 1e-13}
# Power iteration on B = U diag(0.6^i) Vᵀ (r = min(m, n) = 12, smallest σ = 0.6^11 ≈ 3.6e-3)
# converges like 0.36^t. After 30 steps ‖P Qᵀ − U Vᵀ‖_F / ‖U Vᵀ‖_F measured ≤ 7.7e-13 in fp64
# with ε = 0, and ≤ 8.2e-6 in fp32 with ε = 1e-8 (the fp32 floor: round-off in the small σ).
POWER_STEPS = 30
POLAR_TOL = {torch.float64: 1e-10, torch.float32: 3e-5}
# Rank r = 4 < min(m, n): ‖(I − P Pᵀ) U_r‖₂ after 30 steps measured ≤ 2.3e-13 (fp64), ≤ 2.4e-7 (fp32).
SUBSPACE_TOL = {torch.float64: 1e-10, torch.float32: 2e-6}
# ‖Pᵀ(B − P Rᵀ)‖_F / ‖B‖_F for one step: measured ≤ 2.7e-16 (fp64), ≤ 1.6e-7 (fp32).
RESIDUAL_TOL = {torch.float64: 1e-13, torch.float32: 1e-6}

DTYPES = [torch.float32, torch.float64]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def orthonormality_error(q: torch.Tensor) -> torch.Tensor:
    """max |QᵀQ − I| per matrix, in float64."""
    q64 = q.to(torch.float64)
    eye = torch.eye(q.shape[-1], dtype=torch.float64)
    return (q64.mT @ q64 - eye).abs().amax((-2, -1))


def span_error(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """max_j ‖(I − QQᵀ) p_j‖ / ‖p_j‖ per matrix over the nonzero columns p_j of P, in float64."""
    q64, p64 = q.to(torch.float64), p.to(torch.float64)
    resid = torch.linalg.vector_norm(p64 - q64 @ (q64.mT @ p64), dim=-2)
    norms = torch.linalg.vector_norm(p64, dim=-2)
    rel = torch.where(norms > 0, resid / norms.clamp_min(1e-300), torch.zeros_like(resid))
    return rel.amax(-1)


def naive_cholesky_qr2(p: torch.Tensor) -> torch.Tensor:
    """Two Cholesky-QR passes with no safeguard, to show which inputs need the fallback."""
    for _ in range(2):
        L, _ = torch.linalg.cholesky_ex(p.mT @ p)
        p = torch.linalg.solve_triangular(L.mT, p, upper=True, left=False)
    return p


def orthonormal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64)).Q


# ---------------------------------------------------------------------------------------------
# orthonormalize_columns


@pytest.mark.parametrize("method", ["cholesky_qr", "qr"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4, 64, 8), (3, 128, 32), (2, 512, 64), (2, 16, 16)], ids=str)
def test_columns_orthonormal_and_span_kept(shape, dtype, method):
    p = torch.randn(*shape, generator=_gen(sum(shape)), dtype=torch.float64).to(dtype)
    q = orthonormalize_columns(p, method)
    assert q.shape == p.shape and q.dtype == dtype
    assert orthonormality_error(q).max().item() <= ORTHO_TOL[dtype]
    assert span_error(q, p).max().item() <= SPAN_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cholesky_qr_and_householder_give_the_same_basis(dtype):
    """Full-rank QR is unique up to the sign of each column: |Q_cholᵀ Q_qr| = I."""
    p = torch.randn(3, 96, 12, generator=_gen(11), dtype=torch.float64).to(dtype)
    c = orthonormalize_columns(p, "cholesky_qr").to(torch.float64)
    h = orthonormalize_columns(p, "qr").to(torch.float64)
    assert ((c.mT @ h).abs() - torch.eye(12, dtype=torch.float64)).abs().max().item() <= 10 * ORTHO_TOL[dtype]


def _hard_batch(dtype: torch.dtype) -> torch.Tensor:
    """Four 64×8 matrices: three on which plain Cholesky-QR breaks down, then a healthy one."""
    gen = _gen(5)
    p = torch.randn(4, 64, 8, generator=gen, dtype=torch.float64)
    p[0, :, 3] = 0.0  # a zero column: singular Gram matrix
    p[1] = p[1, :, :4] @ torch.randn(4, 8, generator=gen, dtype=torch.float64)  # rank 4 of 8
    s = torch.logspace(0, -12, 8, dtype=torch.float64)  # κ = 1e12, columns mixed
    p[2] = (orthonormal((64, 8), gen) * s) @ orthonormal((8, 8), gen).mT
    return p.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_householder_fallback_on_rank_deficient_and_ill_conditioned(dtype):
    p = _hard_batch(dtype)
    # The inputs are really hard: unguarded Cholesky-QR2 gives non-finite or non-orthonormal Q. For
    # the rank-deficient one that depends on the CPU's rounding (on some its Q comes out orthonormal
    # by luck); its Gram matrix is then numerically singular, smallest eigenvalue under ε of the largest.
    naive = naive_cholesky_qr2(p)
    for i in range(3):
        failed = not torch.isfinite(naive[i]).all() or orthonormality_error(naive[i]).item() > 1e-2
        if i == 1 and not failed:
            eigenvalues = torch.linalg.eigvalsh(p[i].double().mT @ p[i].double()).abs()
            failed = bool(eigenvalues.min() < torch.finfo(dtype).eps * eigenvalues.max())
        assert failed

    q = orthonormalize_columns(p)
    assert q.shape == p.shape and q.dtype == dtype
    assert torch.isfinite(q).all()
    assert orthonormality_error(q).max().item() <= ORTHO_TOL[dtype]
    assert span_error(q, p).max().item() <= SPAN_TOL[dtype]
    # The three hard matrices got Householder QR, the healthy one is unaffected by its neighbours.
    householder = torch.linalg.qr(p[:3]).Q
    assert (q[:3] - householder).abs().max().item() <= 10 * ORTHO_TOL[dtype]
    alone = orthonormalize_columns(p[3:])
    assert (q[3:] - alone).abs().max().item() <= 10 * ORTHO_TOL[dtype]


def _rotated_kahan(n: int, rows: int, seed: int) -> torch.Tensor:
    """Kahan's matrix (κ ≈ 1e8 at n = 30), rotated into ``rows`` dimensions: its Cholesky diagonal
    spreads little, so that spread's estimate of κ is far too low."""
    s, c = math.sin(1.0), math.cos(1.0)
    kahan = torch.diag(s ** torch.arange(n, dtype=torch.float64)) @ (
        torch.eye(n, dtype=torch.float64) - c * torch.ones(n, n, dtype=torch.float64).triu(1))
    return orthonormal((rows, n), _gen(seed)) @ kahan


def test_a_first_pass_far_from_orthonormal_falls_back_to_householder():
    """Both passes' Cholesky diagonals looked healthy on these fp32 matrices while the first pass's Q was
    far from orthonormal (max|Q₁ᵀQ₁ − I| up to 0.3), and CholeskyQR2 returned it almost as it was."""
    p = torch.stack([_rotated_kahan(30, 128, seed) for seed in range(12)]).float()
    first, ok = cholesky_qr_pass(p)
    fooled = ok & (orthonormality_error(first) > 0.1)  # trusted, yet far from orthonormal
    assert int(fooled.sum()) >= 2
    q = orthonormalize_columns(p)
    assert orthonormality_error(q).max().item() <= ORTHO_TOL[torch.float32]
    assert (q[fooled] - torch.linalg.qr(p[fooled]).Q).abs().max().item() == 0.0  # they took Householder QR
    # The sharded rule's own CholeskyQR2 (here on one process: its collectives are no-ops) as well.
    from orthoptim.distributed.low_rank import sharded_low_rank_factors
    eye = torch.eye(30)
    pr = sharded_low_rank_factors(list(p), [eye] * len(p), full_rows=128, rows_group=None, replicate=None, stats=None)
    assert orthonormality_error(pr[:, :128]).max().item() <= ORTHO_TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_duplicated_and_tiny_columns(dtype):
    gen = _gen(6)
    p = torch.randn(2, 64, 8, generator=gen, dtype=torch.float64)
    p[0, :, 3] = p[0, :, 5]  # a duplicated column
    p[1, :, :4] *= 1e-12  # half the columns 12 orders of magnitude smaller
    p = p.to(dtype)
    q = orthonormalize_columns(p)
    assert torch.isfinite(q).all()
    assert orthonormality_error(q).max().item() <= ORTHO_TOL[dtype]
    # Every column, the tiny ones included (relative to their own norm), lies in span(Q).
    assert span_error(q, p).max().item() <= SPAN_TOL[dtype]


def test_half_precision_input():
    p = torch.randn(3, 64, 8, generator=_gen(7)).to(torch.bfloat16)
    q = orthonormalize_columns(p)
    assert q.dtype == torch.bfloat16
    # Computed in fp32, then rounded to bf16 (unit round-off 2^-8 ≈ 4e-3): measured 1.4e-3.
    assert orthonormality_error(q).max().item() <= 1e-2


def test_unknown_method_raises():
    p = torch.randn(2, 16, 4, generator=_gen(8))
    with pytest.raises(ValueError, match=r"'householder'.*cholesky_qr.*qr"):
        orthonormalize_columns(p, "householder")
    with pytest.raises(ValueError, match="svd_qr"):
        power_iteration(torch.randn(2, 16, 16, generator=_gen(9)), torch.randn(2, 16, 4, generator=_gen(10)), "svd_qr")


# ---------------------------------------------------------------------------------------------
# power_iteration + normalize_columns


def fixed_matrix(batch: int, m: int, n: int, dtype: torch.dtype, seed: int):
    """B = U diag(0.6^i) Vᵀ: well separated singular values (ratio 0.6), with its factors."""
    gen = _gen(seed)
    r = min(m, n)
    u = orthonormal((batch, m, r), gen)
    v = orthonormal((batch, n, r), gen)
    s = 0.6 ** torch.arange(r, dtype=torch.float64)
    return ((u * s) @ v.mT).to(dtype), u, v


def run_power_iteration(b, r, steps, eps, seed, method="cholesky_qr"):
    """Steps of Dion's iteration from a random Q; yields (P, Q) after each step."""
    q = torch.randn(b.shape[0], b.shape[-1], r, generator=_gen(seed), dtype=b.dtype)
    for _ in range(steps):
        p, r_ = power_iteration(b, q, method)
        q = normalize_columns(r_, eps)
        yield p, q


@pytest.mark.parametrize("method", ["cholesky_qr", "qr"])
@pytest.mark.parametrize(("dtype", "eps"), [(torch.float64, 0.0), (torch.float32, 1e-8)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(48, 12), (12, 48), (12, 12)], ids=str)
def test_full_rank_converges_to_polar_factor(shape, dtype, eps, method):
    m, n = shape
    b, u, v = fixed_matrix(2, m, n, dtype, seed=m + 2 * n)
    polar = u @ v.mT
    r = min(m, n)
    errors = []
    for p, q in run_power_iteration(b, r, POWER_STEPS, eps, seed=m * n, method=method):
        assert p.shape == (2, m, r) and q.shape == (2, n, r)
        update = (p @ q.mT).to(torch.float64)
        errors.append((torch.linalg.matrix_norm(update - polar) / math.sqrt(r)).max().item())
    # It starts far away (the limit is not reached by construction), and converges.
    assert errors[0] > 0.1
    assert errors[-1] <= POLAR_TOL[dtype], f"after {POWER_STEPS} steps: {errors[-1]:.2e}"


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float64, 0.0), (torch.float32, 1e-8)], ids=["fp64", "fp32"])
@pytest.mark.parametrize("shape", [(48, 12), (12, 48), (12, 12)], ids=str)
def test_low_rank_spans_top_singular_subspace(shape, dtype, eps):
    m, n = shape
    rank = 4
    b, u, v = fixed_matrix(2, m, n, dtype, seed=3 * m + n)
    u_r, v_r = u[..., :rank], v[..., :rank]
    *_, (p, q) = run_power_iteration(b, rank, POWER_STEPS, eps, seed=m + n)
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    # ‖(I − P Pᵀ) U_r‖₂ = sin of the largest principal angle between span(P) and span(U_r).
    sin_max = torch.linalg.matrix_norm(u_r - p64 @ (p64.mT @ u_r), ord=2).max().item()
    assert sin_max <= SUBSPACE_TOL[dtype]
    # Cosines of the principal angles: all 1.
    cosines = torch.linalg.svdvals(u_r.mT @ p64)
    assert (1 - cosines).abs().max().item() <= SUBSPACE_TOL[dtype]
    # And the update P Qᵀ is the rank-r truncated polar factor U_r V_rᵀ.
    err = (torch.linalg.matrix_norm(p64 @ q64.mT - u_r @ v_r.mT) / math.sqrt(rank)).max().item()
    assert err <= POLAR_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("m", "n", "r"), [(64, 32, 8), (32, 64, 8), (128, 64, 16)])
def test_residual_is_orthogonal_to_p(m, n, r, dtype):
    """Error feedback relies on Pᵀ(B − P Rᵀ) = 0: what the low-rank update P Rᵀ leaves out of B is
    orthogonal to P, because R = Bᵀ P and PᵀP = I."""
    gen = _gen(m + n + r)
    b = torch.randn(3, m, n, generator=gen, dtype=torch.float64).to(dtype)
    q = torch.randn(3, n, r, generator=gen, dtype=torch.float64).to(dtype)
    p, r_ = power_iteration(b, q)
    assert p.shape == (3, m, r) and r_.shape == (3, n, r)
    torch.testing.assert_close(r_, b.mT @ p)
    resid = p.mT @ (b - p @ r_.mT)
    rel = (torch.linalg.matrix_norm(resid.to(torch.float64)) / torch.linalg.matrix_norm(b.to(torch.float64))).max()
    assert rel.item() <= RESIDUAL_TOL[dtype]
    # P spans the column space of B Q.
    assert span_error(p, b @ q).max().item() <= SPAN_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_normalize_columns(dtype):
    r = torch.randn(3, 20, 5, generator=_gen(12), dtype=torch.float64).to(dtype)
    r[1, :, 2] = 0.0
    q = normalize_columns(r, 1e-8)
    norms = torch.linalg.vector_norm(q.to(torch.float64), dim=-2)
    expected = torch.ones_like(norms)
    expected[1, 2] = 0.0  # a zero column stays zero (ε-guarded), not NaN
    assert torch.isfinite(q).all()
    # Unit norm up to round-off and the ε guard (ε/‖r_j‖ ≈ 2e-9 here).
    tol = {torch.float32: 1e-6, torch.float64: 1e-8}[dtype]
    assert (norms - expected).abs().max().item() <= tol
    # Directions are kept: each column is a positive multiple of the input column.
    r64 = r.to(torch.float64)
    cos = (q.to(torch.float64) * r64).sum(-2) / (norms * torch.linalg.vector_norm(r64, dim=-2)).clamp_min(1e-30)
    assert (cos - expected).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_normalize_columns_keeps_zero_columns_zero_in_every_dtype(dtype):
    """In fp16 an eps of 1e-8 rounds to 0: computed in fp16, a zero column became 0/0 = NaN."""
    r = torch.randn(2, 6, 3, dtype=torch.float64)
    r[0, :, 1] = 0
    q = normalize_columns(r.to(dtype), 1e-8)
    assert q.dtype == dtype and torch.isfinite(q).all()
    assert torch.equal(q[0, :, 1], torch.zeros(6, dtype=dtype))
    expected = r / (r.norm(dim=-2, keepdim=True) + 1e-8)
    torch.testing.assert_close(q.double(), expected, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_dion_with_fp16_parameters_survives_a_zero_gradient():
    p = torch.nn.Parameter(torch.randn(16, 8).half())
    opt = orthoptim.Dion([p], lr=0.01, rank_fraction=0.5)
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.isfinite(opt.state[p]["Q"]).all() and torch.isfinite(p).all()
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("shape", [(16, 8), (3, 12, 20)], ids=["matrix", "experts"])
def test_dion_after_a_zero_gradient_step_is_dion_without_it(shape, capturable):
    """A zero B gives R = 0: Q's columns must survive it (a zero Q made the next P QR's e_1..e_r, and
    the update hit only the first r rows). After the zero step M is still 0 and Q is the initial Q, so
    the next step is exactly a fresh optimizer's first step."""
    gen = torch.Generator().manual_seed(5)
    x0, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    results = []
    for zero_first in (False, True):
        p = torch.nn.Parameter(x0.clone())
        opt = orthoptim.Dion([p], lr=0.1, rank_fraction=0.5, weight_decay=0.0, capturable=capturable)
        if zero_first:
            p.grad = torch.zeros_like(p)
            opt.step()
            assert torch.equal(p.detach(), x0)
        p.grad = grad.clone()
        opt.step()
        results.append((p.detach().clone(), opt.state[p]["Q"].clone()))
    (x_plain, q_plain), (x_after_zero, q_after_zero) = results
    assert torch.equal(x_after_zero, x_plain) and torch.equal(q_after_zero, q_plain)


def test_dion_keeps_the_columns_of_q_of_an_expert_without_gradient():
    """One 3-D parameter, one expert with a zero gradient: only that expert's Q is kept as it was."""
    p = torch.nn.Parameter(torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(6)))
    opt = orthoptim.Dion([p], lr=0.1, rank_fraction=0.5)
    q0 = opt.state[p]["Q"].clone()
    grad = torch.randn(3, 12, 20, generator=torch.Generator().manual_seed(7))
    grad[1] = 0
    p.grad = grad
    opt.step()
    q = opt.state[p]["Q"]
    assert torch.equal(q[1], q0[1]) and not torch.equal(q[0], q0[0]) and not torch.equal(q[2], q0[2])
