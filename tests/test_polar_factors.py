"""The factored polar iterations (the last product left to the caller) and Muon's use of them.

With a named orthogonalizer and nothing to communicate, Muon lets the iteration's last product write
into the parameters (``X.addmm_(left, right, beta=1 − lr·wd, alpha=−lr·s)``). Passing the same
iteration as a plain callable takes the unfused path (orthogonalize, decay, add); the two must agree
to round-off, for every shape and option, and the fused path must really be the one taken.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import orthoptim
from orthoptim.benchmark_counts import count_step
from orthoptim.orthogonalize import (
    POLAR_EXPRESS,
    PolarFactors,
    get_factored_orthogonalizer,
    gram_newton_schulz_factors,
    newton_schulz_factors,
)


def _textbook_newton_schulz(x):
    """X ← aX + (bA + cA²)X, A = X Xᵀ, per matrix on the short side, after X/‖X‖_F (float64)."""
    out = []
    for m in x:
        t = m.shape[0] > m.shape[1]
        y = m.T if t else m
        y = y / (y.norm() + 1e-7)
        for a, b, c in POLAR_EXPRESS:
            A = y @ y.T
            y = a * y + (b * A + c * A @ A) @ y
        out.append(y.T if t else y)
    return torch.stack(out)


@pytest.mark.parametrize("shape", [(3, 12, 20), (3, 20, 12), (2, 16, 16)])
@pytest.mark.parametrize("factored", [newton_schulz_factors, gram_newton_schulz_factors])
def test_factors_multiply_to_the_polar_iteration(shape, factored):
    x = torch.randn(shape, dtype=torch.float64)
    f = factored(x)
    k, n = min(shape[1:]), max(shape[1:])
    assert isinstance(f, PolarFactors) and f.transposed == (shape[1] > shape[2])
    assert f.left.shape == (shape[0], k, k) and f.right.shape == (shape[0], k, n)
    assert torch.allclose(f.product(), _textbook_newton_schulz(x), atol=1e-9)
    assert torch.allclose(f.finish(x.float()), _textbook_newton_schulz(x).float(), atol=1e-6)


@pytest.mark.parametrize("shape", [(3, 12, 20), (3, 20, 12)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_newton_schulz_iterates_in_contiguous_buffers(shape, dtype):
    """A tall input is iterated transposed (in bf16 on CPU its normalized X keeps that layout); the
    iterates must still land in contiguous buffers (a transposed-layout output makes CPU baddbmm
    over 1000x slower), and the input is not written."""
    x = torch.randn(shape, dtype=torch.float64)
    before = x.clone()
    f = newton_schulz_factors(x, dtype=dtype)
    assert f.right.is_contiguous() and f.left.is_contiguous()
    assert torch.equal(x, before)
    # The product comes back contiguous in the input's orientation (a tall input's is computed as
    # rightᵀ leftᵀ, not returned as a transposed view), so the update reads it along the grain.
    product = f.product()
    assert product.shape == x.shape and product.is_contiguous()
    torch.testing.assert_close(product.double(), (f.left.double() @ f.right.double()).mT if f.transposed
                               else f.left.double() @ f.right.double(), rtol=1e-2, atol=1e-2)
    atol = 1e-9 if dtype == torch.float64 else 0.1  # bf16 iterations: a few bf16 ulps per entry
    assert torch.allclose(product.double(), _textbook_newton_schulz(x), atol=atol)


def test_only_named_iterations_have_a_factored_form():
    assert get_factored_orthogonalizer("polar_express") is not None
    assert get_factored_orthogonalizer("gram") is not None
    assert get_factored_orthogonalizer("svd") is None
    assert get_factored_orthogonalizer(orthoptim.newton_schulz) is None
    custom = partial(orthoptim.newton_schulz, coefficients="polar_express")
    custom.factored = partial(newton_schulz_factors, coefficients="polar_express")
    assert get_factored_orthogonalizer(custom) is custom.factored  # a callable may bring its own


def test_ladder_symmetric_rung_fuses_like_muon():
    from orthoptim.benchmark import symmetric_newton_schulz

    params = [torch.randn(12, 20, requires_grad=True) for _ in range(2)]
    opt = orthoptim.Muon(params, orthogonalizer=symmetric_newton_schulz)
    for p in params:
        p.grad = torch.randn_like(p)
    assert count_step(opt.step, params).ops["addmm_"]["calls"] == len(params)


def _pair(shape, dtype, seed, n=3):
    gen = torch.Generator().manual_seed(seed)
    a = [torch.randn(shape, generator=gen).to(dtype).requires_grad_() for _ in range(n)]
    b = [p.detach().clone().requires_grad_() for p in a]
    return a, b


def _run(fused_params, plain_params, name, *, steps=3, seed=0, **kwargs):
    plain_fn = {"polar_express": partial(orthoptim.newton_schulz, coefficients="polar_express"),
                "gram": partial(orthoptim.gram_newton_schulz, coefficients="polar_express")}[name]
    fused = orthoptim.Muon(fused_params, orthogonalizer=name, **kwargs)
    plain = orthoptim.Muon(plain_params, orthogonalizer=plain_fn, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for a, b in zip(fused_params, plain_params):
            g = torch.randn(a.shape, generator=gen).to(device=a.device, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    return fused, plain


@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (16, 16)])
@pytest.mark.parametrize("name", ["polar_express", "gram"])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_fused_muon_step_equals_the_unfused_one(shape, name, nesterov, dtype, tol):
    a, b = _pair(shape, dtype, seed=1)
    fused, plain = _run(a, b, name, nesterov=nesterov, lr=0.05, weight_decay=0.1, mu=0.9)
    for p, q in zip(a, b):
        change = (q.detach() - p.detach()).abs().max()
        size = q.detach().abs().max()
        assert change <= tol * size, f"parameters differ by {change:.3g}"
        assert torch.equal(fused.state[p]["momentum"], plain.state[q]["momentum"])


def test_fused_path_is_taken_and_writes_into_the_parameters():
    a, b = _pair((12, 20), torch.float32, seed=2)
    fused, plain = _run(a, b, "polar_express", steps=1)
    for p in a:
        p.grad = torch.randn_like(p)
    fused_ops = count_step(fused.step, a).ops
    for p in b:
        p.grad = torch.randn_like(p)
    plain_ops = count_step(plain.step, b).ops
    assert fused_ops["addmm_"]["calls"] == len(a)  # one GEMM per matrix: decay + update + last product
    assert "addmm_" not in plain_ops
    assert plain_ops["bmm"]["calls"] == fused_ops["bmm"]["calls"] + 1  # the product the fused path skips


def test_fused_step_with_tensor_lr_and_layout_views():
    """Capturable (0-dim tensor lr), fused QKV heads (row-block views) and conv weights (flattened)."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 8), (6, 4, 3, 3)]
    a = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    b = [p.detach().clone().requires_grad_() for p in a]
    kwargs = dict(lr=0.03, weight_decay=0.2, capturable=True, flatten=True)
    plain_fn = partial(orthoptim.newton_schulz, coefficients="polar_express")
    fused = orthoptim.Muon([{"params": [a[0]], "num_heads": 3}, {"params": [a[1]]}], **kwargs)
    plain = orthoptim.Muon([{"params": [b[0]], "num_heads": 3}, {"params": [b[1]]}], orthogonalizer=plain_fn,
                           **kwargs)
    for _ in range(3):
        for p, q in zip(a, b):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        fused.step()
        plain.step()
    for p, q in zip(a, b):
        assert torch.allclose(p, q, rtol=0, atol=2e-6 * q.abs().max().item())


def test_bf16_parameters_round_once_like_the_unfused_step():
    """With fp32 iterations (the suite pins ORTHOPTIM_CPU_DTYPE=float32), bf16 parameters take the
    unfused path: decay and the fp32 update computed in fp32 and rounded once. The callable's update
    is rounded to bf16 (the momentum's dtype) before that, so the two agree within an ulp."""
    a, b = _pair((12, 20), torch.bfloat16, seed=4)
    _run(a, b, "polar_express", weight_decay=0.1)
    for p, q in zip(a, b):
        ulp = torch.finfo(torch.bfloat16).eps * q.detach().float().abs().max()
        assert (p.detach().float() - q.detach().float()).abs().max() <= ulp
    c, _ = _pair((12, 20), torch.bfloat16, seed=4)
    opt = orthoptim.Muon(c, orthogonalizer="polar_express")
    for p in c:
        p.grad = torch.randn_like(p)
    assert "addmm_" not in count_step(opt.step, c).ops


def test_bf16_parameters_under_bf16_iterations_fuse(monkeypatch):
    """Where the CPU default is bf16, bf16 parameters match the iteration's dtype and take the fused
    addmm_: one rounding of decay + update instead of two, so within an ulp of the unfused step."""
    from orthoptim.kernels import cpu_dtype

    monkeypatch.setenv(cpu_dtype.ENV_VAR, "bfloat16")
    a, b = _pair((12, 20), torch.bfloat16, seed=5)
    fused, plain = _run(a, b, "polar_express", steps=1, weight_decay=0.1)
    for p in a:
        p.grad = torch.randn_like(p)
    assert count_step(fused.step, a).ops["addmm_"]["calls"] == len(a)
    for p, q in zip(a, b):
        q.grad = p.grad.clone()
    plain.step()
    for p, q in zip(a, b):
        ulp = torch.finfo(torch.bfloat16).eps * q.detach().float().abs().max()
        assert (p.detach().float() - q.detach().float()).abs().max() <= 2 * ulp


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused update on a GPU needs CUDA")
def test_fused_muon_step_on_cuda_bf16():
    """On CUDA, Newton-Schulz runs in bf16: bf16 parameters big enough for the fused path take it, and
    the update matches the unfused one up to bf16 rounding (one rounding instead of three)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    shape = (1024, 4096)
    a = [torch.randn(shape, generator=gen, device="cuda").bfloat16().requires_grad_() for _ in range(2)]
    b = [p.detach().clone().requires_grad_() for p in a]
    fused, plain = _run(a, b, "polar_express", steps=1, lr=0.02, weight_decay=0.1)  # equal momenta after it
    x_a = [p.detach().float().clone() for p in a]
    x_b = [q.detach().float().clone() for q in b]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    assert count_step(fused.step, a).ops["addmm_"]["calls"] == len(a)
    plain.step()
    for p, q, xa, xb in zip(a, b, x_a, x_b):
        d_fused, d_plain = p.detach().float() - xa, q.detach().float() - xb
        assert (d_fused - d_plain).norm() <= 2e-2 * d_plain.norm()
