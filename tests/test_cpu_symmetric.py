"""The blocked CPU symmetric products (``kernels.cpu_symmetric``) against float64 references, their
selection, and the polar iterations run through them."""

from __future__ import annotations

import pytest
import torch

from orthoptim import kernels
from orthoptim.kernels import cpu_dtype, cpu_symmetric, select
from orthoptim.orthogonalize import gram_newton_schulz, newton_schulz, svd_polar

F64 = torch.float64
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, F64: {"rtol": 1e-12, "atol": 1e-11}}


def symmetric_problem(batch, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, k, n, generator=gen, dtype=F64)
    r = x @ x.mT / n
    p = 0.5 * torch.eye(k, dtype=F64) - 0.7 * r + 0.2 * r @ r  # a polynomial in R: commutes with it
    return x, r, p


def assert_symmetric(c):
    assert torch.equal(c, c.mT) or (c - c.mT).abs().max() <= 8 * torch.finfo(c.dtype).eps * c.abs().max()


# Sides that are, and are not, multiples of the block; one block only; more blocks than rows of one.
@pytest.mark.parametrize("k, n, block", [(96, 130, 32), (100, 80, 32), (33, 70, 40), (17, 17, 5), (64, 9, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, F64, torch.bfloat16])
def test_products_match_float64(k, n, block, dtype):
    x, r, p = symmetric_problem(3, k, n)
    x, r, p = (t.to(dtype) for t in (x, r, p))
    gram = cpu_symmetric.gram(x, block=block)
    poly = cpu_symmetric.symmetric_polynomial(r, 0.5, -0.7, 0.2, block=block)
    prod = cpu_symmetric.symmetric_product(r, p, block=block)
    # float64 references from the inputs as given (rounded to ``dtype``).
    x64, r64, p64 = (t.to(F64) for t in (x, r, p))
    eye = torch.eye(k, dtype=F64)
    for got, exact in ((gram, x64 @ x64.mT), (poly, 0.5 * eye - 0.7 * r64 + 0.2 * r64 @ r64), (prod, r64 @ p64)):
        assert got.dtype == dtype and got.shape == exact.shape
        if dtype == torch.bfloat16:  # one rounding of fp32 sums: 2⁻⁸ of the largest entry, with margin
            assert (got.to(F64) - exact).abs().max() <= 2.0**-7 * exact.abs().max()
        else:
            torch.testing.assert_close(got.to(F64), exact, **TOL[dtype])
        assert torch.equal(got.tril(-block), got.mT.tril(-block))  # the mirrored blocks are exact copies


def test_below_the_diagonal_blocks_are_copies_of_the_ones_above():
    x, r, p = symmetric_problem(2, 70, 90, seed=1)
    for c in (cpu_symmetric.gram(x.float(), block=16), cpu_symmetric.symmetric_product(r.float(), p.float(), block=16)):
        for i in range(0, 70, 16):
            for j in range(i + 16, 70, 16):
                assert torch.equal(c[:, j:j + 16, i:i + 16], c[:, i:i + 16, j:j + 16].mT)


def test_strided_inputs():
    """A tall input's X is a transposed view, and Gram NS feeds column slices: both are BLAS layouts."""
    x, r, p = symmetric_problem(2, 50, 120, seed=2)
    xt = x.mT.contiguous().mT  # same values, column-major
    assert not xt.is_contiguous()
    torch.testing.assert_close(cpu_symmetric.gram(xt, block=16), x @ x.mT, **TOL[F64])
    rt, pt = r.mT.contiguous().mT, p.mT.contiguous().mT
    torch.testing.assert_close(cpu_symmetric.symmetric_product(rt, pt, block=16), r @ p, **TOL[F64])


def test_out_is_used_when_it_fits_and_replaced_when_not():
    x, r, _ = symmetric_problem(2, 40, 60, seed=3)
    out = torch.empty(2, 40, 40, dtype=F64)
    assert cpu_symmetric.gram(x, out=out, block=16) is out
    torch.testing.assert_close(out, x @ x.mT, **TOL[F64])
    for bad in (torch.full((2, 40, 40), 7.0, dtype=F64).mT, torch.full((2, 40, 40), 7.0),
                torch.full((1, 40, 40), 7.0, dtype=F64)):
        got = cpu_symmetric.symmetric_polynomial(r, 1.0, 2.0, 3.0, out=bad, block=16)
        assert got is not bad and got.is_contiguous()
        assert (bad == 7.0).all()  # never written
        torch.testing.assert_close(got, torch.eye(40, dtype=F64) + 2 * r + 3 * r @ r, **TOL[F64])


def test_empty_batches_and_bad_block():
    x = torch.randn(0, 8, 5)
    assert cpu_symmetric.gram(x, block=4).shape == (0, 8, 8)
    with pytest.raises(ValueError, match="block must be a positive"):
        cpu_symmetric.gram(torch.randn(1, 8, 5), block=0)


# ----------------------------------------------------------------------------- selection
@pytest.fixture
def without_amx(monkeypatch):
    """The general thresholds, whatever CPU runs the tests (AMX has its own bf16 one, tested below)."""
    monkeypatch.setattr(cpu_dtype, "amx_tiles", lambda: False)


def test_auto_picks_blocked_products_from_the_threshold_on(monkeypatch, without_amx):
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    k = select.MIN_BLOCKED_SIZE
    for dtype in select.BLOCKED_DTYPES:
        probe = torch.empty(0, dtype=dtype)
        assert kernels.backend(probe, size=k) == "blocked"
        assert kernels.backend(probe, size=k - 1) == "torch"
    assert kernels.backend(torch.empty(0, dtype=F64), size=k) == "torch"  # unmeasured dtypes keep bmm
    assert kernels.backend(torch.empty(0, dtype=torch.float16), size=k) == "torch"
    monkeypatch.setenv(select.ENV_VAR, "torch")
    assert kernels.backend(torch.empty(0), size=4 * k) == "torch"
    monkeypatch.setenv(select.ENV_VAR, "blocked")
    assert kernels.backend(torch.empty(0, dtype=F64), size=2) == "blocked"


def test_on_amx_bf16_products_are_blocked_only_from_their_own_threshold(monkeypatch):
    """AMX's bf16 GEMMs lose more rate in block rows than the blocks save below
    AMX_BF16_MIN_BLOCKED_SIZE, and the wide X Xᵀ rule does not apply to them; fp32 is unchanged."""
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(cpu_dtype, "amx_tiles", lambda: True)
    k, big = select.MIN_BLOCKED_SIZE, select.AMX_BF16_MIN_BLOCKED_SIZE
    assert big > k
    bf16, fp32 = torch.empty(0, dtype=torch.bfloat16), torch.empty(0)
    assert kernels.backend(bf16, size=k) == "torch" and kernels.backend(bf16, size=big - 1) == "torch"
    assert kernels.backend(bf16, size=big) == "blocked"
    wide = select.MIN_BLOCKED_WIDE_GRAM_SIZE
    assert kernels.backend(bf16, size=wide, inner=4 * wide) == "torch"
    assert kernels.backend(fp32, size=k) == "blocked"
    assert kernels.backend(fp32, size=wide, inner=4 * wide) == "blocked"
    monkeypatch.setenv(select.ENV_VAR, "blocked")  # forced: blocked whatever the CPU
    assert kernels.backend(bf16, size=2) == "blocked"


def test_auto_blocks_the_gram_matrix_of_wide_inputs_below_the_threshold(monkeypatch, without_amx):
    """From MIN_BLOCKED_WIDE_GRAM_SIZE on, X Xᵀ of an X at least WIDE_GRAM_ASPECT times as wide is
    blocked (in WIDE_GRAM_BLOCK rows); narrower ones, smaller ones and the k×k products keep bmm."""
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    k = select.MIN_BLOCKED_WIDE_GRAM_SIZE
    wide = select.WIDE_GRAM_ASPECT * k
    assert k < select.MIN_BLOCKED_SIZE
    for dtype in select.BLOCKED_DTYPES:
        probe = torch.empty(0, dtype=dtype)
        assert select.use_blocked(probe, size=k, inner=wide)
        assert not select.use_blocked(probe, size=k, inner=wide - 1)
        assert not select.use_blocked(probe, size=k - 1, inner=4 * k)
        assert not select.use_blocked(probe, size=k)  # a k×k product: no inner side given
    assert not select.use_blocked(torch.empty(0, dtype=F64), size=k, inner=wide)
    assert select.blocked_gram_rows(k, wide) == select.WIDE_GRAM_BLOCK
    assert select.blocked_gram_rows(select.MIN_BLOCKED_SIZE, 4 * select.MIN_BLOCKED_SIZE) is None
    assert select.blocked_gram_rows(k - 1, 4 * k) is None
    assert kernels.backend(torch.empty(0), size=k, inner=wide) == "blocked"
    assert kernels.backend(torch.empty(0), size=k) == "torch"
    monkeypatch.setenv(select.ENV_VAR, "torch")
    assert not select.use_blocked(torch.empty(0), size=k, inner=wide)
    monkeypatch.setenv(select.ENV_VAR, "blocked")  # forced: every product in the module's BLOCK rows
    assert select.blocked_gram_rows(k, wide) is None and select.blocked_gram_rows(36, 90) is None


def test_wide_gram_at_real_size_matches_float64_and_newton_schulz_uses_it(monkeypatch):
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    calls = []
    real = cpu_symmetric.gram
    monkeypatch.setattr(cpu_symmetric, "gram", lambda x, **kw: (calls.append((x.shape[-2], kw.get("block"))),
                                                                 real(x, **kw))[1])
    k = select.MIN_BLOCKED_WIDE_GRAM_SIZE
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, k, select.WIDE_GRAM_ASPECT * k + 8, generator=gen)
    got = kernels.gram(x)
    torch.testing.assert_close(got.double(), x.double() @ x.double().mT, rtol=1e-5, atol=1e-3)
    assert_symmetric(got)
    assert calls == [(k, select.WIDE_GRAM_BLOCK)]
    calls.clear()
    newton_schulz(x.mT, dtype=torch.float32)  # tall: the short side is k, the long one wide
    assert calls == [(k, select.WIDE_GRAM_BLOCK)] * 5
    calls.clear()
    newton_schulz(torch.randn(1, k, k + 8, generator=gen), dtype=torch.float32)
    assert calls == []


def test_dispatch_routes_every_product(monkeypatch):
    calls = []
    for name in ("gram", "symmetric_polynomial", "symmetric_product"):
        real = getattr(cpu_symmetric, name)
        monkeypatch.setattr(cpu_symmetric, name, lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                                           _real(*a, **kw))[1])
    monkeypatch.setenv(select.ENV_VAR, "blocked")
    monkeypatch.setattr(cpu_symmetric, "BLOCK", 8)
    x, r, p = symmetric_problem(2, 20, 30, seed=4)
    torch.testing.assert_close(kernels.gram(x), x @ x.mT, **TOL[F64])
    torch.testing.assert_close(kernels.symmetric_polynomial(r, 0.5, -0.7, 0.2), p, **TOL[F64])
    torch.testing.assert_close(kernels.symmetric_product(r, p), r @ p, **TOL[F64])
    assert calls == ["gram", "symmetric_polynomial", "symmetric_product"]
    calls.clear()
    with pytest.raises(RuntimeError):  # mixed dtypes go to the torch backend, which refuses them
        kernels.symmetric_product(r.float(), p)
    assert calls == []


def test_differentiable_calls_keep_bmm(monkeypatch):
    monkeypatch.setenv(select.ENV_VAR, "blocked")
    x = torch.randn(2, 20, 30, requires_grad=True)
    assert kernels.backend(x, size=20) == "torch"
    kernels.gram(x).sum().backward()  # a blocked product (mm with out=) could not be differentiated
    torch.testing.assert_close(x.grad, 2 * x.detach().sum(-2, keepdim=True).expand(2, 20, 30).clone(),
                               rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert kernels.backend(x, size=20) == "blocked"


def test_auto_sends_newton_schulz_through_blocked_products_from_the_threshold(monkeypatch):
    calls = []
    real = cpu_symmetric.gram
    monkeypatch.setattr(cpu_symmetric, "gram", lambda *a, **kw: (calls.append(a[0].shape[-2]), real(*a, **kw))[1])
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(select, "MIN_BLOCKED_SIZE", 24)
    monkeypatch.setattr(cpu_symmetric, "BLOCK", 8)
    newton_schulz(torch.randn(2, 23, 40), dtype=torch.float32)
    assert calls == []
    newton_schulz(torch.randn(2, 24, 40), dtype=torch.float32)
    newton_schulz(torch.randn(2, 40, 24), dtype=torch.float32)  # tall: the short side counts
    assert calls == [24] * 10


def test_auto_at_real_size_matches_bmm(monkeypatch):
    """At the threshold itself, in fp32, with the module's own block size."""
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    k = select.MIN_BLOCKED_SIZE
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, k + 40, generator=gen)
    got = kernels.gram(x)
    torch.testing.assert_close(got.double(), x.double() @ x.double().mT, rtol=1e-5, atol=1e-3)
    assert_symmetric(got)


# ----------------------------------------------------------------------------- the iterations
@pytest.mark.parametrize("shape", [(3, 40, 40), (2, 36, 90), (2, 90, 36)])
def test_newton_schulz_through_blocked_products_matches_bmm_and_the_polar_factor(monkeypatch, shape):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(*shape, generator=gen)
    monkeypatch.setenv(select.ENV_VAR, "torch")
    plain = newton_schulz(x, dtype=torch.float32)
    plain_gram = gram_newton_schulz(x, dtype=torch.float32)
    monkeypatch.setenv(select.ENV_VAR, "blocked")
    monkeypatch.setattr(cpu_symmetric, "BLOCK", 16)
    blocked = newton_schulz(x, dtype=torch.float32)  # the default on CPUs goes through the kernels
    blocked_gram = gram_newton_schulz(x, dtype=torch.float32)
    torch.testing.assert_close(blocked, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(blocked_gram, plain_gram, rtol=1e-4, atol=1e-4)
    exact = svd_polar(x.double())
    err_plain = torch.linalg.matrix_norm(plain.double() - exact).max()
    err_blocked = torch.linalg.matrix_norm(blocked.double() - exact).max()
    assert abs(err_blocked - err_plain) < 1e-4


def test_newton_schulz_default_uses_the_kernels_on_cpu_and_false_opts_out(monkeypatch):
    calls = []
    real = cpu_symmetric.gram
    monkeypatch.setattr(cpu_symmetric, "gram", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    monkeypatch.setenv(select.ENV_VAR, "blocked")
    x = torch.randn(2, 24, 30)
    newton_schulz(x, dtype=torch.float32)
    assert len(calls) == 5  # one X Xᵀ per iteration
    calls.clear()
    newton_schulz(x, dtype=torch.float32, symmetric_kernels=False)
    assert calls == []


def test_bf16_newton_schulz_error_unchanged(monkeypatch):
    """In bf16 the blocked products round as bmm does: the distance to U Vᵀ stays the same."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 64, 256, generator=gen)
    exact = svd_polar(x.double())
    errors = {}
    for choice in ("torch", "blocked"):
        monkeypatch.setenv(select.ENV_VAR, choice)
        monkeypatch.setattr(cpu_symmetric, "BLOCK", 16)
        out = newton_schulz(x, dtype=torch.bfloat16).double()
        errors[choice] = (torch.linalg.matrix_norm(out - exact) / torch.linalg.matrix_norm(exact)).max().item()
    assert abs(errors["blocked"] - errors["torch"]) < 0.01, errors
