"""fp16/bf16 parameters: weight decay and the update are computed together and rounded to the
parameter dtype once. Rounded on its own, X·(1 − lr·wd) is X again in bf16 whenever lr·wd < 2⁻⁹, so
a rule that decays in a pass of its own loses decoupled weight decay entirely.

Reference: the same first step on fp32 copies of the same (bf16-exact) parameters and gradients,
with an orthogonalizer whose output is the same in both runs, rounded to bf16 once at the end.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import orthoptim
from tests.reference_rules import polar

LR, WD = 0.01, 0.1  # lr·wd = 1e-3 < 2⁻⁹: a decay rounded on its own is lost
# The numbers' rounding is a CPU kernels' habit; on CUDA the same ops are checked (benchmarks/gpu_check.sh).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def bf16_polar(x: torch.Tensor) -> torch.Tensor:
    """The exact polar factor rounded to bf16, in the input's dtype: equal in an fp32 and a bf16 run."""
    return torch.stack([polar(a) for a in x]).to(torch.bfloat16).to(x.dtype)


def first_step(algorithm: str, shape: tuple[int, int], dtype: torch.dtype, capturable: bool,
               weight_decay: float = WD, size: float = 1.0) -> torch.Tensor:
    """``size``: of the initial weights; at 0.01 the update is as large as they are."""
    gen = torch.Generator().manual_seed(7)
    x0 = (size * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    grad = torch.randn(shape, generator=gen).to(torch.bfloat16)
    p = nn.Parameter(x0.to(dtype))
    group = {"params": [p], "algorithm": algorithm}
    if algorithm != "dion":
        group["orthogonalizer"] = bf16_polar
    opt = orthoptim.Dion3([group], lr=LR, weight_decay=weight_decay, fraction=0.5, capturable=capturable)
    p.grad = grad.to(dtype)
    opt.step()
    return p.detach()


def mismatches(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() != want.float()).float().mean().item()


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize(("algorithm", "shape"), [
    ("muon", (16, 24)), ("normuon", (16, 24)), ("dion3", (16, 24)),
    ("dion2", (16, 24)),  # rows selected
    ("dion2", (24, 16)),  # columns selected
])
@pytest.mark.parametrize("size", [1.0, 0.01])
def test_bf16_step_is_the_fp32_step_rounded_once(algorithm, shape, capturable, size):
    want = first_step(algorithm, shape, torch.float32, capturable, size=size).to(torch.bfloat16)
    got = first_step(algorithm, shape, torch.bfloat16, capturable, size=size)
    # A decay rounded on its own changes well over half of them; a normalized update rounded to bf16
    # before the update (NorMuon once did) 1-2 %.
    assert mismatches(got, want) == 0.0, mismatches(got, want)


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2", "dion3", "dion"])
def test_bf16_weight_decay_has_an_effect(algorithm, capturable):
    """The same step with and without weight decay: with it, entries of the updated rows end up
    different, and the parameters smaller. (A decay rounded on its own leaves them equal.)"""
    decayed = first_step(algorithm, (16, 24), torch.bfloat16, capturable)
    plain = first_step(algorithm, (16, 24), torch.bfloat16, capturable, weight_decay=0.0)
    assert mismatches(decayed, plain) > 0.05, mismatches(decayed, plain)
    assert decayed.float().norm() < plain.float().norm()


@pytest.mark.parametrize("algorithm", ["dion", "muon"])
def test_bf16_capturable_steps_round_like_eager_ones(algorithm):
    """Dion and Muon fold the decay into one GEMM eagerly (addmm_'s beta); their capturable steps,
    whose tensor lr cannot be a beta, round once too, to the same values."""
    eager = first_step(algorithm, (16, 24), torch.bfloat16, False)
    captured = first_step(algorithm, (16, 24), torch.bfloat16, True)
    assert mismatches(captured, eager) == 0.0, mismatches(captured, eager)


@pytest.mark.parametrize("update_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_blocked_cpu_decay_and_update_equal_the_two_passes(monkeypatch, update_dtype, weight_decay):
    """fp32 parameters on a CPU take decay and update block by block: bit for bit the decay pass and
    then the update pass, also with a ragged last block and blocks that straddle rows."""
    from orthoptim.rules import weight_decay as wd

    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(37, 29, generator=gen) for _ in range(3)]
    updates = torch.randn(3, 37, 29, generator=gen).to(update_dtype)
    expected = [x.clone() for x in xs]
    wd.decay_(expected, 0.05, weight_decay)
    wd.apply_(expected, updates, 0.05 * 1.7)
    # 9 blocks per matrix, the last one of 49; a multiple of every SIMD width, as the default is, so
    # every element goes through the same vector code as in one pass
    monkeypatch.setattr(wd, "CPU_BLOCK_ELEMENTS", 128)
    assert wd._blocked_on_cpu(xs, updates, 0.05, 0.05 * 1.7)
    wd.decay_and_apply_(xs, updates, 0.05, weight_decay, 0.05 * 1.7)
    for x, e in zip(xs, expected):
        assert torch.equal(x, e)
    assert not wd._blocked_on_cpu([xs[0].t()], updates[:1].mT, 0.05, 0.05)  # views take the two passes
    # an update of another shape is not paired element by element: the two passes' error stands
    assert not wd._blocked_on_cpu([torch.zeros(4, 6)], torch.zeros(1, 6, 4), 0.05, 0.05)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("algorithm", "nesterov"), [("muon", False), ("muon", True), ("normuon", False),
                                                     ("normuon", True)])
@pytest.mark.parametrize("mu", [0.95, 0.99, 0.999])
@pytest.mark.parametrize("device", DEVICES)
def test_half_momentum_decays_with_the_exact_mu(algorithm, nesterov, dtype, mu, device):
    """M ← μM + G rounded once to the momentum's dtype, from the exact μ: CPU kernels round a number
    alpha to bf16 first, where μ = 0.99 is 0.98828 and 0.999 is 1 (a momentum that never decays)."""
    gen = torch.Generator().manual_seed(5)
    p = nn.Parameter(torch.zeros(16, 48, dtype=dtype, device=device))
    group = {"params": [p], "algorithm": algorithm, "orthogonalizer": bf16_polar, "nesterov": nesterov}
    opt = orthoptim.Dion3([group], lr=0.0, weight_decay=0.0, mu=mu)
    m0 = torch.randn(16, 48, generator=gen).to(device, dtype)
    grad = (0.3 * torch.randn(16, 48, generator=gen)).to(device, dtype)
    opt.state[p]["momentum"].copy_(m0)
    p.grad = grad
    opt.step()
    want = (mu * m0.double() + grad.double()).to(dtype)
    # an fp32 sum rounded to the dtype may rarely land the other way of a tie from the exact one
    assert mismatches(opt.state[p]["momentum"], want) <= 0.002, mismatches(opt.state[p]["momentum"], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_lion_decays_and_steps_in_one_rounding(dtype, device, tensor_lr):
    """X·(1 − lr·wd) − lr·sign(·) rounded once from the exact numbers: CPU foreach ops rounded both to
    bf16 first (a decay of lr·wd = 0.0021 became one of 2⁻⁸), and a decay rounded on its own keeps
    little of it (lr·wd < 2⁻⁹: none)."""
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(64, 32, generator=gen).to(device, dtype)
    grad = torch.randn(64, 32, generator=gen).to(device, dtype)
    lr, wd = 0.003, 0.7
    p = nn.Parameter(x0.clone())
    opt = orthoptim.Dion3([{"params": [p], "algorithm": "lion", "weight_decay": wd, "betas": (0.9, 0.99),
                            "lr": torch.tensor(lr, device=device) if tensor_lr else lr}])
    p.grad = grad.clone()
    opt.step()
    want = (x0.double() * (1 - lr * wd) - lr * torch.sign(grad.double())).to(dtype)
    # lr as an fp32 tensor is 0.003 to 1e-10: an entry on a tie may round the other way
    assert mismatches(p.detach(), want) <= (0.002 if tensor_lr else 0.0), mismatches(p.detach(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adamw_steps_a_strided_parameter_as_a_contiguous_one(dtype):
    """torch's fused kernel needs one dense layout; a transposed parameter took the foreach sequence,
    whose CPU ops round their numbers to bf16 (β₂ = 0.999 became 1: the second moment never decayed)."""
    gen = torch.Generator().manual_seed(12)
    x0 = torch.randn(32, 48, generator=gen).to(dtype)
    grads = [torch.randn(32, 48, generator=gen).to(dtype) for _ in range(3)]
    dense = nn.Parameter(x0.clone())
    strided = nn.Parameter(x0.t().contiguous().t())
    assert not strided.is_contiguous()
    hp = {"algorithm": "adamw", "lr": 0.003, "weight_decay": 0.7, "betas": (0.9, 0.999)}
    opts = [orthoptim.Dion3([{"params": [p], **hp}]) for p in (dense, strided)]
    for g in grads:
        for p, opt in zip((dense, strided), opts):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(dense, strided)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(opts[0].state[dense][key], opts[1].state[strided][key]), key


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype is new in torch 2.13")
@pytest.mark.parametrize("algorithm", ["adamw", "lion"])
def test_an_fp32_gradient_too_large_for_an_fp16_vector_is_refused(algorithm):
    """AdamW and Lion take the gradient in the parameter's dtype: a finite fp32 one above 65504 became
    inf there, and the weights NaN, with no error. Refused now, or skipped, as for the matrix rules."""
    x0 = torch.ones(4, dtype=torch.float16)
    grad = torch.tensor([1.0, -2.0, 1e5, 3.0])
    for nonfinite in ("raise", "skip"):
        p = nn.Parameter(x0.clone())
        p.grad_dtype = torch.float32
        opt = orthoptim.Dion3([{"params": [p], "algorithm": algorithm}], nonfinite=nonfinite)
        p.grad = grad.clone()
        if nonfinite == "raise":
            with pytest.raises(orthoptim.NonFiniteGradientError, match="overflow float16"):
                opt.step()
        else:
            with pytest.warns(UserWarning, match="overflow float16"):
                opt.step()
        assert torch.equal(p.detach(), x0)
        assert all(torch.count_nonzero(t) == 0 for t in opt.state[p].values() if t.is_floating_point()
                   and t.ndim), opt.state[p]
    p.grad = torch.tensor([1.0, -2.0, 100.0, 3.0])  # fits float16 (and so does AdamW's second moment): stepped
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(p.detach(), x0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ["dion2", "dion3"])
@pytest.mark.parametrize("mu", [0.95, 0.99])
@pytest.mark.parametrize("device", DEVICES)
def test_selected_rows_decay_with_the_exact_mu(algorithm, dtype, mu, device):
    """Dion2/Dion3: M ← M + G, then the selected rows M[S] ← μ·M[S], rounded once from the exact μ (CPU
    kernels rounded the alpha μ − 1 of the in-place add to bf16: 1 − μ off by up to 2⁻⁹)."""
    gen = torch.Generator().manual_seed(9)
    p = nn.Parameter(torch.zeros(16, 48, dtype=dtype, device=device))
    group = {"params": [p], "algorithm": algorithm, "orthogonalizer": bf16_polar, "fraction": 1.0}
    opt = orthoptim.Dion3([group], lr=0.0, weight_decay=0.0, mu=mu)
    m0 = torch.randn(16, 48, generator=gen).to(device, dtype)
    grad = torch.randn(16, 48, generator=gen).to(device, dtype)
    opt.state[p]["momentum"].copy_(m0)
    p.grad = grad
    opt.step()
    summed = (m0.double() + grad.double()).to(dtype)  # M + G, rounded (the step stores it)
    want = (mu * summed.double()).to(dtype)
    assert mismatches(opt.state[p]["momentum"], want) == 0.0, mismatches(opt.state[p]["momentum"], want)


def test_an_fp16_adamw_second_moment_that_would_overflow_is_refused():
    """A finite fp16 gradient of 1e4: (1 − β₂)·g² = 1e5 does not fit fp16, so the stored second moment
    became inf and the parameter never moved again, silently. Refused now, or skipped; 5e3 fits."""
    p = nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = orthoptim.Dion3([{"params": [p], "algorithm": "adamw", "betas": (0.9, 0.999)}])
    p.grad = torch.tensor([1.0, -2.0, 1e4, 3.0], dtype=torch.float16)
    with pytest.raises(orthoptim.NonFiniteGradientError, match="second moment"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(4, dtype=torch.float16))
    p.grad = torch.tensor([1.0, -2.0, 5e3, 3.0], dtype=torch.float16)
    opt.step()
    assert torch.isfinite(opt.state[p]["exp_avg_sq"]).all() and not torch.equal(p.detach(), torch.ones_like(p))


@pytest.mark.parametrize("capturable", [False, True])
def test_the_second_moment_check_is_exact_past_its_bound(capturable):
    """The bound β₂·max v + (1 − β₂)·max g² can exceed fp16 where no entry does (the largest v and the
    largest g in different entries): such a step is taken, not refused."""
    p = nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = orthoptim.Dion3([{"params": [p], "algorithm": "adamw", "betas": (0.9, 0.5)}], capturable=capturable)
    p.grad = torch.tensor([0.0, 300.0], dtype=torch.float16)
    opt.step()  # v = [0, 45000]
    p.grad = torch.tensor([300.0, 0.0], dtype=torch.float16)  # bound 22500 + 45000 > 65504; entries 45000, 22500
    opt.step()
    if capturable:
        opt.check_nonfinite()  # raises if the step was flagged
    assert torch.isfinite(opt.state[p]["exp_avg_sq"]).all() and opt.state[p]["exp_avg_sq"][0] == 45000
