"""Every update rule against the independent per-matrix reference in ``reference_rules.py``.

The real optimizers run with an exact SVD polar factor as ``orthogonalizer`` on float64 parameters,
so the only differences left are round-off: parameters must match to TOL_X of the update, state to
TOL_STATE, after every one of several steps with fresh random gradients.
"""

from __future__ import annotations

import math

import pytest
import torch

import orthoptim
from tests import reference_rules as ref

F64 = torch.float64
CLASSES = {"muon": orthoptim.Muon, "normuon": orthoptim.NorMuon, "dion2": orthoptim.Dion2,
           "dion3": orthoptim.Dion3, "dion": orthoptim.Dion}
HP = ref.HP
TOL_STATE = ref.TOL_STATE
make_params, drive = ref.make_params, ref.drive


def build(algorithm, params, hp, **group_opts):
    return ref.build(CLASSES[algorithm], algorithm, params, hp, **group_opts)


WIDE, TALL, SQUARE = (12, 20), (20, 12), (16, 16)
# Tall enough that Dion3's selected rows outnumber the columns (k > n): only then does the row
# normalization do more than rescale (orthonormal rows all have norm 1).
VERY_TALL = (32, 8)


# ----------------------------------------------------------------------------- Muon, NorMuon
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", [WIDE, TALL, SQUARE])
def test_muon(nesterov, shape):
    params = make_params([shape, shape], seed=1)
    opt, reference = build("muon", params, {**HP, "nesterov": nesterov})
    drive(opt, reference, seed=1)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("shape", [WIDE, TALL, VERY_TALL])
def test_normuon(nesterov, shape):
    params = make_params([shape, shape], seed=2)
    opt, reference = build("normuon", params, {**HP, "nesterov": nesterov})
    drive(opt, reference, seed=2)


@pytest.mark.parametrize("algorithm", ["normuon", "dion3"])
def test_normalization_epsilon_is_used(algorithm):
    """ε large enough to matter in Ô = O / (√V + ε). The overall size of Ô is checked by
    test_normalized_update_has_frobenius_norm_of_o; here the direction of each step's update and V
    must match the reference with this ε, and must not match one with a negligible ε. The matrix is
    tall with more selected rows than columns: only then do the rows of O differ in norm (orthonormal
    rows all have norm 1, and normalizing them changes nothing but the scale)."""
    hp = {**HP, "epsilon": 0.05, "weight_decay": 0.0, "fraction": 0.5}
    shape = (24, 8)
    (p,) = params = make_params([shape], seed=3)
    opt, with_eps = build(algorithm, params, hp)
    _, without_eps = build(algorithm, params, {**hp, "epsilon": 1e-30})
    gen = torch.Generator().manual_seed(3)

    def direction(t):
        return t / t.norm()

    for _ in range(3):
        g = torch.randn(shape, generator=gen, dtype=F64)
        x_lib, x_eps, x_no = p.detach().clone(), with_eps.params()[0], without_eps.params()[0]
        p.grad = g.clone()
        opt.step()
        with_eps.step([[g]])
        without_eps.step([[g]])
        d_lib = direction(x_lib - p.detach())
        assert ref.rel_err(d_lib, direction(x_eps - with_eps.params()[0])) <= 1e-6
        assert ref.rel_err(d_lib, direction(x_no - without_eps.params()[0])) >= 1e-3
        v_lib = opt.state[p]["variance"].reshape(-1)
        assert ref.rel_err(v_lib, with_eps.groups[0][1][0]["v"][0]) <= ref.TOL_STATE


@pytest.mark.parametrize("algorithm", ["normuon", "dion3"])
def test_normalized_update_has_frobenius_norm_of_o(algorithm):
    """DESIGN §1: Ô is rescaled to ‖O‖_F. With the exact polar factor ‖O‖_F = √rank(U) = √min(k, n),
    so the update (after weight decay) has Frobenius norm lr·s·√min(k, n), whatever ε is."""
    shape = WIDE
    hp = {**HP, "epsilon": 1e-3, "weight_decay": 0.0}
    (p,) = make_params([shape], seed=4)
    opt, _ = build(algorithm, [p], hp)
    before = p.detach().clone()
    p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    opt.step()
    rows = shape[0] if algorithm == "normuon" else ref.ceil_fraction(hp["fraction"], shape[0])
    want = hp["lr"] * math.sqrt(shape[0] / shape[1]) * math.sqrt(min(rows, shape[1]))
    got = float((p.detach() - before).norm())
    assert got == pytest.approx(want, rel=1e-6)


# ----------------------------------------------------------------------------- Dion2, Dion3
@pytest.mark.parametrize("fraction", [0.25, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("shape", [WIDE, TALL, SQUARE], ids=["wide-rows", "tall-columns", "square-rows"])
def test_dion2(shape, fraction):
    params = make_params([shape, shape], seed=5)
    hp = {**HP, "fraction": fraction}
    opt, reference = build("dion2", params, hp)
    rows, cols = shape
    dim = 0 if rows <= cols else 1
    k = ref.ceil_fraction(fraction, shape[dim])

    def check(t, before, grads):
        for p, x_before in zip(params, before):
            changed = ((p.detach() - x_before * (1 - hp["lr"] * hp["weight_decay"])).abs() > 1e-14)
            per_slice = changed.any(dim=1 - dim)
            assert int(per_slice.sum()) == k, f"step {t + 1}: {int(per_slice.sum())} slices updated, expected {k}"
            assert torch.equal(per_slice, changed.all(dim=1 - dim)), "a selected slice was only partly updated"

    drive(opt, reference, seed=5, after_step=check)


@pytest.mark.parametrize("shape", [WIDE, TALL, SQUARE, VERY_TALL])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_dion3(shape, fraction):
    params = make_params([shape, shape], seed=6)
    hp = {**HP, "fraction": fraction}
    opt, reference = build("dion3", params, hp)
    k = ref.ceil_fraction(fraction, shape[0])
    v_prev = [opt.state[p]["variance"].clone() for p in params]

    def check(t, before, grads):
        for j, (p, x_before) in enumerate(zip(params, before)):
            changed = ((p.detach() - x_before * (1 - hp["lr"] * hp["weight_decay"])).abs() > 1e-14).any(dim=1)
            assert int(changed.sum()) == k, f"step {t + 1}: {int(changed.sum())} rows updated, expected {k} (rows)"
            v = opt.state[p]["variance"].reshape(-1)
            v_changed = v != v_prev[j].reshape(-1)
            assert torch.equal(v_changed, changed), "V changed on rows other than the selected ones"
            v_prev[j] = v.clone()

    drive(opt, reference, seed=6, after_step=check)


def test_dion3_defaults_match_design():
    """Dion3 with only the orthogonalizer given uses DESIGN §2's defaults."""
    defaults = {"lr": 0.01, "fraction": 0.25, "mu": 0.95, "muon_beta2": 0.95, "betas": (0.9, 0.95),
                "weight_decay": 0.01, "epsilon": 1e-8, "adjust_lr": "spectral_norm"}
    params = make_params([(16, 24), (24, 16)], seed=7)
    opt = orthoptim.Dion3(params, orthogonalizer=ref.exact_polar_batch)
    reference = ref.Reference([{"params": params, "algorithm": "dion3", **defaults}])
    drive(opt, reference, seed=7)


# ----------------------------------------------------------------------------- Dion
@pytest.mark.parametrize("rank_fraction", [1.0, 0.5, 0.3])
@pytest.mark.parametrize("shape", [WIDE, TALL, SQUARE])
@pytest.mark.parametrize("qr_method", ["cholesky_qr", "qr"])
def test_dion(shape, rank_fraction, qr_method):
    params = make_params([shape, shape], seed=8)
    opt, reference = build("dion", params, {**HP, "rank_fraction": rank_fraction})
    opt.param_groups[0]["qr_method"] = qr_method
    r = ref.dion_rank(rank_fraction, *shape)
    assert opt.state[params[0]]["Q"].shape[-1] == r

    def check(t, before, grads):
        # The low-rank update P Qᵀ is unique even though P's column signs are not.
        (_, entries), = reference.groups
        for p, x_before, e in zip(params, before, entries):
            update = (x_before * (1 - HP["lr"] * HP["weight_decay"]) - p.detach()) / HP["lr"]
            s = math.sqrt(shape[0] / shape[1])
            want = s * e["p"][0] @ e["q"][0].T
            assert ref.rel_err(update, want) <= 1e-9
            assert torch.linalg.matrix_rank(update, rtol=1e-9).item() == r

    drive(opt, reference, seed=8, after_step=check)


@pytest.mark.parametrize("mu", [0.0, 0.6])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_dion_error_feedback_keeps_what_was_not_applied(shape, mu):
    """M_new = B − (1−μ)·P Rᵀ with P taken from the library's own update (its column space);
    with μ = 0 the new momentum is B minus its projection onto P: Pᵀ M_new = 0."""
    hp = {**HP, "mu": mu, "rank_fraction": 0.25, "weight_decay": 0.0}
    params = make_params([shape], seed=9)
    opt, _ = build("dion", params, hp)
    (p,) = params
    r = ref.dion_rank(0.25, *shape)
    gen = torch.Generator().manual_seed(9)
    for _ in range(4):
        b = opt.state[p]["momentum"].clone()
        g = torch.randn(shape, generator=gen, dtype=F64)
        b = b + g
        before = p.detach().clone()
        p.grad = g
        opt.step()
        u, sv, _ = torch.linalg.svd(before - p.detach())
        assert sv[r:].max() <= 1e-12 * sv[0], "the Dion update is not rank r"
        P = u[:, :r]  # orthonormal basis of the update's column space = span(P)
        m_new = opt.state[p]["momentum"]
        assert ref.rel_err(m_new, b - (1 - mu) * P @ (P.T @ b)) <= 1e-12
        if mu == 0.0:
            assert ref.max_abs(P.T @ m_new) <= 1e-12 * ref.max_abs(b)


def test_dion_keeps_the_right_factor_of_a_zero_column_of_r_only():
    """A first gradient whose only nonzero row is the first: B Q = e₀ wᵀ has rank 1, Householder QR
    (Cholesky-QR fails on it) gives P = [e₀ … e_{r−1}] exactly (its reflectors of zero vectors are the
    identity), and R = Bᵀ P is zero in every column but the first. Those columns of Q keep their old
    values: none becomes zero, which would leave that direction out of every later B Q. A zero *row*
    of R (a zero column of B) is no such case: Q's row is 0 and the update leaves that column of X alone.
    (With the nonzero row elsewhere, P's completion is orthogonal to it only up to rounding: R is then
    ~1e-16 there, not zero, and Q's column is R/(‖R‖ + ε), tiny but a real direction of B's rows.)"""
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        p = torch.nn.Parameter(torch.randn(16, 8, generator=gen, dtype=F64))
        opt = orthoptim.Dion([p], lr=0.1, rank_fraction=0.5, weight_decay=0.0)
        q0 = opt.state[p]["Q"][0].clone()
        g = torch.zeros(16, 8, dtype=F64)
        g[0] = torch.randn(8, generator=gen, dtype=F64)
        p.grad = g
        opt.step()
        q = opt.state[p]["Q"][0]
        # R's first column is ±‖g‖ĝ: Q's is ±ĝ·‖g‖/(‖g‖ + ε), ε = 1e-8
        assert abs(float(q[:, 0] @ g[0]) / float(g[0].norm())) >= 1 - 1e-7
        for j in range(1, q.shape[1]):
            assert torch.equal(q[:, j], q0[:, j]), f"column {j} of Q was not kept"

    p = torch.nn.Parameter(torch.randn(16, 8, generator=gen, dtype=F64))
    opt = orthoptim.Dion([p], lr=0.1, rank_fraction=0.5, weight_decay=0.0)
    before = p.detach().clone()
    g = torch.randn(16, 8, generator=gen, dtype=F64)
    g[:, 5] = 0.0
    p.grad = g
    opt.step()
    assert opt.state[p]["Q"][0, 5].abs().max().item() == 0.0
    assert torch.equal(p.detach()[:, 5], before[:, 5])
    assert (p.detach() - before).abs().max().item() > 0


# ----------------------------------------------------------------------------- AdamW, Lion
@pytest.mark.parametrize("scalar", ["adamw", "lion"])
def test_scalar_groups(scalar):
    """AdamW (bias-corrected, decoupled wd) and Lion groups, next to a matrix group, plain lr."""
    matrices = make_params([(8, 12)], seed=10)
    vectors = make_params([(12,), (8, 12), (3, 4, 5)], seed=11)
    scalar_hp = {"lr": 0.03, "weight_decay": 0.2, "betas": (0.8, 0.9)}
    if scalar == "adamw":  # Lion has no epsilon
        scalar_hp["epsilon"] = 1e-6
    groups = [{"params": matrices, "algorithm": "muon"},
              {"params": vectors, "algorithm": scalar, **scalar_hp}]
    opt = orthoptim.Dion3(groups, lr=0.05, mu=0.9, weight_decay=0.1, orthogonalizer=ref.exact_polar_batch)
    reference = ref.Reference([{"params": matrices, "algorithm": "muon", **HP},
                               {"params": vectors, "algorithm": scalar, **scalar_hp}])
    drive(opt, reference, seed=10)


# ----------------------------------------------------------------------------- weight decay, lr scale
@pytest.mark.parametrize("adjust_lr", ["spectral_norm", "rms_norm", "original", None])
@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2", "dion3", "dion"])
def test_adjust_lr_and_weight_decay(algorithm, adjust_lr):
    hp = {**HP, "adjust_lr": adjust_lr, "weight_decay": 0.5}
    params = make_params([(8, 32), (32, 8)], seed=12)
    opt, reference = build(algorithm, params, hp)
    drive(opt, reference, seed=12, steps=3)


@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2", "dion3", "dion"])
def test_weight_decay_applies_to_every_row_with_zero_gradient(algorithm):
    """A zero gradient after a warm-up step: every entry of X still decays by (1 − lr·wd) before the update."""
    hp = {**HP, "weight_decay": 0.5}
    params = make_params([(8, 16)], seed=13)
    opt, reference = build(algorithm, params, hp)
    drive(opt, reference, seed=13, steps=1)
    (p,) = params
    before = p.detach().clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    reference.step([[torch.zeros_like(p)]])
    ref.compare(opt, reference, [before], tol_x=ref.TOL_X, tol_state=TOL_STATE, where="zero-gradient step")


def off_the_fused_kernel(monkeypatch) -> None:
    """AdamW's foreach path, which CUDA takes without capturable=True (host step counts)."""
    from orthoptim.rules import adamw

    monkeypatch.setattr(adamw, "_fused_applies", lambda lists, step: False)


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_with_gradients_laid_out_unlike_their_parameters(monkeypatch, fused):
    """A transposed-view gradient must not reach a kernel that walks memory linearly as it is: the
    fused kernel takes a contiguous copy."""
    if not fused:
        off_the_fused_kernel(monkeypatch)
    p = torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    g = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).t()
    opt = orthoptim.Dion3([{"params": [p], "algorithm": "adamw", "lr": 0.01, "weight_decay": 0.1,
                            "betas": (0.9, 0.95), "epsilon": 1e-8}])
    x0 = p.detach().clone()
    p.grad = g
    opt.step()
    want, _, _ = ref.adamw(x0, g, torch.zeros_like(g), torch.zeros_like(g), 1, lr=0.01, wd=0.1, beta1=0.9,
                           beta2=0.95, eps=1e-8)
    assert ref.rel_err(p.detach(), want) <= 1e-8  # a layout mix-up moves entries: errors ~1e-2


def test_capturable_adamw_off_the_fused_kernel(monkeypatch):
    """capturable=True off torch's fused kernel: the step counts stay device tensors and the bias
    corrections are formed from them."""
    off_the_fused_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64, generator=gen)) for _ in range(2)]
    hp = {"lr": 0.01, "wd": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    opt = orthoptim.Dion3([{"params": params, "algorithm": "adamw", "lr": hp["lr"], "weight_decay": hp["wd"],
                            "betas": (hp["beta1"], hp["beta2"]), "epsilon": hp["eps"]}], capturable=True)
    x0 = [p.detach().clone() for p in params]
    want = [(x, torch.zeros_like(x), torch.zeros_like(x)) for x in x0]
    for t in range(1, 4):  # the bias corrections matter most in the first steps
        for i, p in enumerate(params):
            g = torch.randn(4, 6, dtype=torch.float64, generator=gen).t()
            p.grad = g
            x, m, v = want[i]
            want[i] = ref.adamw(x, g, m, v, t, **hp)
        opt.step()
        for p, start, (x, m, v) in zip(params, x0, want):
            # relative to the change so far: the corrections in float64, as the parameters (from fp32
            # step counts they were off by 5-8e-6; a missing √ of the correction: 0.3)
            assert ref.rel_err(p.detach(), x, ref.max_abs(x - start)) <= 1e-12
            assert ref.rel_err(opt.state[p]["exp_avg"], m) <= 1e-12
            assert ref.rel_err(opt.state[p]["exp_avg_sq"], v) <= 1e-12


def test_adamw_off_the_fused_kernel_has_float64_bias_corrections_per_parameter(monkeypatch):
    """The foreach path's bias corrections came from fp32 step tensors (1 − β₂ᵗ lost 7e-6 of the
    update to cancellation) and assumed one step count for the batch; here one parameter skips a
    step, so the two counts differ."""
    off_the_fused_kernel(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(6, 4, dtype=torch.float64, generator=gen)) for _ in range(2)]
    hp = {"lr": 0.01, "wd": 0.1, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    opt = orthoptim.Dion3([{"params": params, "algorithm": "adamw", "lr": hp["lr"], "weight_decay": hp["wd"],
                            "betas": (hp["beta1"], hp["beta2"]), "epsilon": hp["eps"]}])
    want = [(p.detach().clone(), torch.zeros(6, 4, dtype=torch.float64), torch.zeros(6, 4, dtype=torch.float64), 0)
            for p in params]
    for step in range(4):
        for i, p in enumerate(params):
            if step == 1 and i == 1:
                p.grad = None
                continue
            g = torch.randn(4, 6, dtype=torch.float64, generator=gen).t()
            p.grad = g
            x, m, v, t = want[i]
            want[i] = (*ref.adamw(x, g, m, v, t + 1, **hp), t + 1)
        opt.step()
    for p, (x, _, _, _) in zip(params, want):
        assert ref.rel_err(p.detach(), x) <= 1e-13
