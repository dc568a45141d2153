"""The kernels layer without Triton: the torch backend against float64 references, and the backend choice.

The float64 references here (``dion3_reference``, ``ulp``, ``assert_single_rounding``) are written
from the equations in DESIGN.md §1 and shared with ``test_kernels_triton.py``.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

from orthoptim import kernels
from orthoptim.kernels import select, torch_backend
from orthoptim.rules import normalization, selection, weight_decay

F64 = torch.float64


# ----------------------------------------------------------------------------- float64 references
def dion3_reference(
    params: list[torch.Tensor], index: torch.Tensor, o: torch.Tensor, v: torch.Tensor | None, *,
    lr: float, weight_decay: float, scale: float, beta2: float, eps: float, normalize: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per matrix, in float64: V' = β₂V + (1−β₂)·mean_j(O²); Ô = O/(√V'+ε) rescaled to ‖O‖_F;
    X ← X(1 − lr·wd); X[S] ← X[S] − lr·scale·Ô. ``index`` may be ragged (a list; O, V zero-padded).
    Returns (new X in float64, V' [B, k] or, for a ragged index, a list of the unpadded V')."""  # fmt: skip
    xs, vs = [], []
    for b, x in enumerate(params):
        rows = len(index[b])
        x64, o64 = x.to(F64).clone(), o[b, :rows].to(F64)
        if normalize:
            v_new = beta2 * v[b, :rows].to(F64) + (1 - beta2) * o64.square().mean(-1)
            o_hat = o64 / (v_new.sqrt() + eps).unsqueeze(-1)
            norm_hat = torch.linalg.matrix_norm(o_hat)
            o_hat = o_hat * (torch.linalg.matrix_norm(o64) / norm_hat) if norm_hat > 0 else o_hat * 0
            vs.append(v_new)
        else:
            o_hat = o64
        x64 = x64 * (1 - lr * weight_decay)
        x64[index[b]] -= lr * scale * o_hat
        xs.append(x64)
    if not normalize:
        return xs, None
    return xs, (torch.stack(vs) if isinstance(index, torch.Tensor) else vs)


MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` numbers around the float64 values ``y`` (subnormal spacing at least)."""
    _, exponent = torch.frexp(y.to(F64))  # |y| = m·2^e with m in [0.5, 1)
    bits = MANTISSA_BITS[dtype]
    spacing = torch.pow(2.0, (exponent - bits - 1).to(F64))
    return spacing.clamp_min(torch.finfo(dtype).smallest_normal * 2.0**-bits)


def rounding_excess(out: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor) -> float:
    """max over elements of |out − exact| / ulp(exact) beyond half an ulp and the fp32 slack (≤ 0 is good)."""
    err = (out.to(F64) - exact).abs() - slack
    return (err / ulp(exact, out.dtype)).amax().item() - 0.5


def assert_single_rounding(out: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor) -> None:
    """Every element of ``out`` (half precision) is ``exact`` rounded once: within half an ulp, plus
    the error of an fp32 computation (a few 2⁻²⁴ of the magnitudes that were added)."""
    excess = rounding_excess(out, exact, 8 * 2.0**-24 * magnitude)
    assert excess <= 0, f"an element is {excess + 0.5:.3f} ulp from the exact value (one rounding allows 0.5)"


def dion3_problem(batch, m, n, k, dtype, *, seed=0, o_dtype=None, layout="list"):
    """Parameters (list of views, 3-D tensor or column-major views), distinct unsorted row indices,
    O rows and fp32 variances; the values are Dion3-like (X ~ 0.02, O ~ 1/√n rows, V ~ mean O²)."""
    gen = torch.Generator().manual_seed(seed)
    base = (0.02 * torch.randn(batch, m, n, generator=gen, dtype=F64)).to(dtype)
    if layout == "tensor":
        params = base
    elif layout == "list":  # row blocks of one buffer: same strides, different storage offsets
        params = list(base.reshape(batch * m, n).split(m))
    elif layout == "colmajor":
        params = [p.mT.contiguous().mT for p in base.unbind(0)]
    else:
        raise ValueError(layout)
    index = torch.stack([torch.randperm(m, generator=gen)[:k] for _ in range(batch)])
    o = (torch.randn(batch, k, n, generator=gen, dtype=F64) / n**0.5).to(o_dtype or dtype)
    v = (torch.rand(batch, k, generator=gen, dtype=F64) / n).to(torch.float32)
    return params, index, o, v


def ragged_problem(m, n, lengths, dtype, *, seed=0):
    """A list of index tensors of different lengths, with O and V zero-padded to the longest."""
    params, index, o, v = dion3_problem(len(lengths), m, n, max(lengths), dtype, seed=seed, layout="list")
    ragged = [i[:length] for i, length in zip(index, lengths)]
    for b, length in enumerate(lengths):
        o[b, length:] = 0
        v[b, length:] = 0
    return params, ragged, o, v


HYPER = {"lr": 0.02, "weight_decay": 0.1, "scale": 1.5, "beta2": 0.95, "eps": 1e-8}


def as_list(params) -> list[torch.Tensor]:
    return list(params.unbind(0)) if isinstance(params, torch.Tensor) else list(params)


# ----------------------------------------------------------------------------- torch backend
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_symmetric_products_torch(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 11, generator=gen, dtype=F64)
    r = x @ x.mT
    p = 2.0 * torch.eye(7, dtype=F64) - 0.5 * r + 0.25 * r @ r
    tol = {"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(torch_backend.gram(x.to(dtype)).to(F64), r, **tol)
    torch.testing.assert_close(torch_backend.symmetric_polynomial(r.to(dtype), 2.0, -0.5, 0.25).to(F64), p, **tol)
    torch.testing.assert_close(torch_backend.symmetric_product(r.to(dtype), p.to(dtype)).to(F64), r @ p, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_row_sums_of_squares_match_float64(dtype):
    gen = torch.Generator().manual_seed(2)
    o = torch.randn(3, 5, 37, generator=gen, dtype=F64)
    o[1, 2].zero_()  # an all-zero row sums to exactly 0
    got = torch_backend.row_sums_of_squares(o.to(dtype))
    assert got.shape == (3, 5) and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(got.to(F64), o.square().sum(-1), rtol=tol, atol=0)
    assert got[1, 2] == 0


@pytest.mark.parametrize("layout", ["list", "tensor", "colmajor"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("normalize", [True, False])
def test_dion3_post_update_torch_matches_float64(layout, dtype, normalize):
    params, index, o, v = dion3_problem(3, 13, 9, 4, dtype, layout=layout)
    exact_x, exact_v = dion3_reference(as_list(params), index, o, v, normalize=normalize, **HYPER)
    v_new = torch_backend.dion3_post_update(params, index, o, v if normalize else None, normalize=normalize, **HYPER)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    for x, ref in zip(as_list(params), exact_x):
        torch.testing.assert_close(x.to(F64), ref, rtol=tol, atol=tol * 0.02)
    if normalize:
        assert v_new.dtype == v.dtype
        torch.testing.assert_close(v_new.to(F64), exact_v, rtol=2e-6, atol=0)
    else:
        assert v_new is None


@pytest.mark.parametrize("normalize", [True, False])
def test_dion3_post_update_torch_ragged_index(normalize):
    """A ragged selection (a list of index tensors, O and V zero-padded): the padding is never written."""
    params, index, o, v = ragged_problem(11, 7, [4, 0, 2], torch.float32, seed=4)
    exact_x, exact_v = dion3_reference(params, index, o, v, normalize=normalize, **HYPER)
    v_new = torch_backend.dion3_post_update(params, index, o, v if normalize else None, normalize=normalize, **HYPER)
    for b, (x, ref) in enumerate(zip(params, exact_x)):
        torch.testing.assert_close(x.to(F64), ref, rtol=2e-6, atol=1e-8)
        if normalize:
            torch.testing.assert_close(v_new[b, : len(index[b])].to(F64), exact_v[b], rtol=2e-6, atol=0)


def test_dion3_post_update_torch_equals_the_unfused_rule_in_fp64():
    """Same numbers as Dion3's current post-update (normalize_rows → decay_ → add_slices_) in fp64."""
    params, index, o, v = dion3_problem(2, 10, 8, 3, F64, layout="list")
    copies = [p.clone() for p in params]
    v_new = torch_backend.dion3_post_update(params, index, o, v.to(F64), **HYPER)
    o_hat, v_old_path = normalization.normalize_rows(o, v.to(F64), HYPER["beta2"], HYPER["eps"])
    weight_decay.decay_(copies, HYPER["lr"], HYPER["weight_decay"])
    selection.add_slices_(copies, index, o_hat, 0, alpha=-HYPER["lr"] * HYPER["scale"])
    torch.testing.assert_close(v_new, v_old_path, rtol=1e-14, atol=0)
    for x, y in zip(params, copies):
        torch.testing.assert_close(x, y, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dion3_post_update_torch_rounds_once(dtype):
    """Half-precision parameters end within half an ulp of the exact result; the unfused path
    (decay in the parameter dtype, Ô in the parameter dtype, then index_add) does not."""
    params, index, o, v = dion3_problem(2, 48, 40, 24, dtype, seed=3, layout="list")
    before = [p.clone() for p in params]
    exact_x, _ = dion3_reference(params, index, o, v, **HYPER)
    torch_backend.dion3_post_update(params, index, o, v, **HYPER)
    magnitude = [p.to(F64).abs() + (e - p.to(F64)).abs() for p, e in zip(before, exact_x)]
    for x, ref, mag in zip(params, exact_x, magnitude):
        assert_single_rounding(x, ref, mag)

    # The test has teeth: two roundings break the half-ulp bound somewhere on the same problem.
    unfused = [p.clone() for p in before]
    o_hat, _ = normalization.orthogonalize_and_normalize(o, v, orthogonalize=lambda u: u, beta2=0.95, eps=1e-8)
    weight_decay.decay_(unfused, HYPER["lr"], HYPER["weight_decay"])
    selection.add_slices_(unfused, index, o_hat, 0, alpha=-HYPER["lr"] * HYPER["scale"])
    excess = max(rounding_excess(x, ref, 8 * 2.0**-24 * mag) for x, ref, mag in zip(unfused, exact_x, magnitude))
    assert excess > 0


def test_dion3_post_update_zero_rows_and_no_decay():
    """O = 0 leaves the selected rows decayed only (0/0 stays 0); wd = 0 leaves other rows bit-equal."""
    params, index, o, v = dion3_problem(2, 9, 6, 3, torch.float32, layout="tensor")
    before = params.clone()
    o[0].zero_()
    torch_backend.dion3_post_update(params, index, o, v, **{**HYPER, "weight_decay": 0.0})
    assert torch.equal(params[0], before[0])
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[index[1]] = False
    assert torch.equal(params[1][untouched], before[1][untouched])
    assert not torch.equal(params[1], before[1])


# ----------------------------------------------------------------------------- backend choice
def test_backend_choice(monkeypatch):
    x = torch.randn(2, 4, 8)
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    assert kernels.backend(x, 4096) == "blocked"  # CPU tensors never go to Triton under auto
    assert kernels.backend(x, 64) == "torch"
    monkeypatch.setenv(select.ENV_VAR, "torch")
    assert kernels.backend(x, 4096) == "torch"
    monkeypatch.setenv(select.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="ORTHOPTIM_KERNELS='cuda'"):
        kernels.gram(x)
    monkeypatch.setenv(select.ENV_VAR, "triton")
    monkeypatch.setattr(select, "triton_installed", lambda: False)
    with pytest.raises(ImportError, match="triton"):
        kernels.gram(x)
    assert kernels.backend(x.double()) == "torch"  # float64 never goes to Triton


def test_dispatch_keeps_torch_results_on_cpu(monkeypatch):
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    x = torch.randn(2, 5, 9)
    assert torch.equal(kernels.gram(x), torch.bmm(x, x.mT))
    r = kernels.gram(x)
    assert torch.equal(kernels.symmetric_product(r, r), torch.bmm(r, r))
    assert torch.equal(kernels.symmetric_polynomial(r, 1.0, 2.0, 3.0), torch_backend.symmetric_polynomial(r, 1, 2, 3))


def test_import_does_not_import_triton():
    code = (
        "import sys, torch, orthoptim\n"
        "from orthoptim import kernels\n"
        "from orthoptim.orthogonalize import gram_newton_schulz\n"
        "gram_newton_schulz(torch.randn(2, 8, 16))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- the optional QuACK backend, driven on the CPU through a stand-in for its kernel -----------------

def _fake_quack(monkeypatch, kernel):
    """Make ``quack_symmetric`` believe QuACK is installed and can run, with ``kernel`` as its GEMM."""
    import types

    from orthoptim.kernels import quack_symmetric

    module = types.ModuleType("quack.gemm_interface")
    module.gemm_symmetric = kernel
    monkeypatch.setitem(__import__("sys").modules, "quack.gemm_interface", module)
    monkeypatch.setattr(quack_symmetric, "can_run", lambda *tensors: quack_symmetric._disabled is None)
    monkeypatch.setattr(quack_symmetric, "_disabled", None)
    monkeypatch.setattr(quack_symmetric, "_verified", set())
    monkeypatch.setenv("ORTHOPTIM_KERNELS", "quack")
    return quack_symmetric


def _gemm_like_quack(calls):
    def gemm_symmetric(a, b, C=None, alpha=1.0, beta=1.0):
        calls.append(a.shape)
        out = alpha * (a @ b)
        return out + beta * C if C is not None else out
    return gemm_symmetric


def test_quack_backend_runs_gram_newton_schulz_and_matches_torch(monkeypatch):
    from orthoptim.orthogonalize import gram_newton_schulz

    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("ORTHOPTIM_KERNELS", "torch")
    want = gram_newton_schulz(x)
    calls = []
    _fake_quack(monkeypatch, _gemm_like_quack(calls))
    assert kernels.backend(x, 16) == "quack"
    got = gram_newton_schulz(x)
    assert len(calls) >= 10  # X Xᵀ, and the polynomial and product of every iteration
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("failure", ["raises", "zeros"])
@pytest.mark.parametrize("k", [8, 64])
def test_quack_backend_that_fails_is_switched_off_with_one_warning(monkeypatch, failure, k):
    def broken(a, b, C=None, alpha=1.0, beta=1.0):
        if failure == "raises":
            raise TypeError("unexpected keyword")  # e.g. an interface change between releases
        return torch.zeros(a.shape[0], a.shape[1], b.shape[-1])

    quack = _fake_quack(monkeypatch, broken)
    x = torch.randn(2, k, 4 * k, generator=torch.Generator().manual_seed(1))
    x = x / x.norm(dim=(-2, -1), keepdim=True)  # as Newton-Schulz calls it: small Gram entries
    with pytest.warns(RuntimeWarning, match="QuACK"):
        got = kernels.gram(x)
    torch.testing.assert_close(got, x @ x.mT)  # the torch result, not the broken one
    assert quack._disabled is not None
    assert kernels.backend(x, k) == "torch"


def test_quack_backend_is_checked_per_product(monkeypatch):
    """A kernel right for X Xᵀ but wrong with a C operand is caught at the polynomial's first use."""
    def ignores_c(a, b, C=None, alpha=1.0, beta=1.0):
        return alpha * (a @ b)

    quack = _fake_quack(monkeypatch, ignores_c)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(kernels.gram(x), x @ x.mT)
    assert quack._disabled is None
    r = x @ x.mT
    with pytest.warns(RuntimeWarning, match="symmetric_polynomial"):
        got = kernels.symmetric_polynomial(r, 1.5, -0.5, 0.25)
    want = 1.5 * torch.eye(16) - 0.5 * r + 0.25 * r @ r
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _fake_triton(monkeypatch, failing: set[str]):
    """CPU tensors routed to Triton as CUDA ones would be under ``auto``, with a module whose
    ``failing`` functions raise as Triton does on an image without a C compiler."""
    calls = []

    def kernel(name):
        def run(*args, **kwargs):
            calls.append(name)
            if name in failing:
                raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
            return getattr(torch_backend, name)(*args, **kwargs)
        return run

    module = type(sys)("fake_triton_kernels")
    for name in ("gram", "symmetric_polynomial", "symmetric_product", "dion3_post_update"):
        setattr(module, name, kernel(name))
    module.supported = lambda params: True
    monkeypatch.delenv(select.ENV_VAR, raising=False)
    monkeypatch.setattr(select, "_triton_off", {})
    monkeypatch.setattr(select, "triton_installed", lambda: True)
    monkeypatch.setattr(select, "_on_cuda", lambda tensors: True)
    monkeypatch.setattr(select, "triton_module", lambda name: module)
    return calls


def test_triton_kernel_that_fails_hands_over_to_torch_with_one_warning(monkeypatch):
    calls = _fake_triton(monkeypatch, failing={"gram"})
    x = torch.randn(2, select.MIN_TRITON_SIZE, 8, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert kernels.backend(x, x.shape[-2]) == "triton"
    with pytest.warns(RuntimeWarning, match="C compiler.*torch backend"):
        got = kernels.gram(x)
    torch.testing.assert_close(got, x @ x.mT)
    assert kernels.backend(x, x.shape[-2]) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning, and the kernel is not tried again
        torch.testing.assert_close(kernels.gram(x), x @ x.mT)
    assert calls == ["gram"]
    monkeypatch.setenv(select.ENV_VAR, "triton")  # forced: the error is the caller's to see
    with pytest.raises(RuntimeError, match="C compiler"):
        kernels.gram(x)


def test_auto_keeps_fp32_symmetric_products_on_torch_and_16_bit_ones_on_triton(monkeypatch):
    """fp32 tl.dot has no tensor cores without TF32: ``auto`` leaves fp32 to cuBLAS."""
    _fake_triton(monkeypatch, failing=set())
    x = torch.randn(1, select.MIN_TRITON_SIZE, 8)
    assert kernels.backend(x, x.shape[-2]) == "torch"
    for dtype in (torch.float16, torch.bfloat16):
        assert kernels.backend(x.to(dtype), x.shape[-2]) == "triton"
    monkeypatch.setenv(select.ENV_VAR, "triton")  # forced: fp32 too
    assert kernels.backend(x, x.shape[-2]) == "triton"


def test_a_triton_kernel_out_of_memory_is_raised_and_keeps_triton_on(monkeypatch):
    calls = _fake_triton(monkeypatch, failing=set())
    module = select.triton_module("triton_symmetric")

    def out_of_memory(*args, **kwargs):
        calls.append("gram")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(module, "gram", out_of_memory)
    x = torch.randn(2, select.MIN_TRITON_SIZE, 8).bfloat16()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        kernels.gram(x)
    assert select._triton_off == {} and kernels.backend(x, x.shape[-2]) == "triton"


@pytest.mark.parametrize("normalize", [True, False])
def test_fused_dion3_triton_that_fails_leaves_the_torch_update(monkeypatch, normalize):
    calls = _fake_triton(monkeypatch, failing={"dion3_post_update"})
    params, index, o, v = dion3_problem(2, 12, 10, 4, torch.float32, seed=4, layout="list")
    expected = [p.clone() for p in params]
    expected_v = torch_backend.dion3_post_update(expected, index, o, v.clone(), normalize=normalize, **HYPER)
    with pytest.warns(RuntimeWarning, match="triton_dion3"):
        got_v = kernels.dion3_post_update(params, index, o, v, normalize=normalize, **HYPER)
    assert calls == ["dion3_post_update"]
    for p, e in zip(params, expected):
        assert torch.equal(p, e)
    assert (got_v is None) == (not normalize)
    if normalize:
        assert torch.equal(got_v, expected_v)


def test_a_zero_row_with_a_tiny_epsilon_keeps_the_dion3_update_finite():
    """With V = 0 a zero row's denominator is ε, and ε² underflows fp32 for ε ≲ 1e-23: divided by d²,
    0/0 was NaN, which the Frobenius rescale spread to every row of the matrix."""
    params, index, o, v = dion3_problem(1, 12, 10, 4, torch.float32, seed=9)
    o[0, 1] = 0
    v[0, 1] = 0
    expected = [p.clone() for p in params]
    got_v = kernels.dion3_post_update(params, index, o, v, normalize=True, **{**HYPER, "eps": 1e-30})
    assert all(torch.isfinite(p).all() for p in params) and torch.isfinite(got_v).all()
    row = int(index[0, 1])
    torch.testing.assert_close(params[0][row], expected[0][row] * (1 - HYPER["lr"] * HYPER["weight_decay"]))
    assert not torch.equal(params[0][int(index[0, 0])], expected[0][int(index[0, 0])])


def test_a_zero_row_with_an_epsilon_near_the_fp32_floor_gets_a_zero_factor():
    """ratio/ε overflows to inf for ε ≲ 1e-41, and a zero row's 0·inf would be NaN."""
    sumsq = torch.tensor([[1.0, 0.0]])
    scale, _ = torch_backend.normalized_row_scale(sumsq, torch.zeros(1, 2), 4, 0.95, 1e-44)
    assert torch.isfinite(scale).all() and scale[0, 1] == 0 and scale[0, 0] > 0
