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


def bf16_polar(x: torch.Tensor) -> torch.Tensor:
    """The exact polar factor rounded to bf16, in the input's dtype: equal in an fp32 and a bf16 run."""
    return torch.stack([polar(a) for a in x]).to(torch.bfloat16).to(x.dtype)


def first_step(algorithm: str, shape: tuple[int, int], dtype: torch.dtype, capturable: bool,
               weight_decay: float = WD) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    x0 = torch.randn(shape, generator=gen).to(torch.bfloat16)
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
def test_bf16_step_is_the_fp32_step_rounded_once(algorithm, shape, capturable):
    want = first_step(algorithm, shape, torch.float32, capturable).to(torch.bfloat16)
    got = first_step(algorithm, shape, torch.bfloat16, capturable)
    # NorMuon's normalized update is itself a bf16 tensor in the bf16 run: a few entries may round the
    # other way. A decay rounded on its own changes well over half of them.
    assert mismatches(got, want) <= (0.02 if algorithm == "normuon" else 0.0), mismatches(got, want)


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
