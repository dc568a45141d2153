"""The polar iterations' dtype on CPUs: bf16 where the CPU multiplies bf16 natively, fp32 elsewhere.

The rest of the suite pins ``ORTHOPTIM_CPU_DTYPE=float32`` (conftest) so that its fp32 tolerances
hold on every machine; here the automatic choice and the bf16 path are checked on any CPU (bf16
matmuls run everywhere, only slowly without bf16 units), against float64 references.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

import orthoptim
from orthoptim.kernels import cpu_dtype
from orthoptim.orthogonalize import DEFAULT_RESTARTS, gram_newton_schulz, input_dtype, newton_schulz
from orthoptim.orthogonalize._common import normalize
from orthoptim.rules import momentum as momentum_rules
from orthoptim.rules.momentum import accumulate_and_stack
from tests.reference_rules import exact_polar_batch


def _gaussian(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def auto(monkeypatch):
    """The automatic choice, with the CPU's bf16 support set by the test."""
    monkeypatch.setenv(cpu_dtype.ENV_VAR, "auto")

    def has_bf16_units(value: bool) -> None:
        monkeypatch.setattr(cpu_dtype, "native_bf16_matmul", lambda: value)

    return has_bf16_units


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_cpus_bf16_units(auto, native, expected):
    auto(native)
    assert cpu_dtype.iteration_dtype() == expected
    x = _gaussian(2, 8, 16)
    assert torch.equal(newton_schulz(x), newton_schulz(x, dtype=expected))


@pytest.mark.parametrize(("value", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                                 (" BFloat16 ", torch.bfloat16), ("", None)])
def test_the_environment_variable_overrides_the_choice(monkeypatch, value, expected):
    monkeypatch.setenv(cpu_dtype.ENV_VAR, value)
    monkeypatch.setattr(cpu_dtype, "native_bf16_matmul", lambda: True)
    assert cpu_dtype.iteration_dtype() == (expected or torch.bfloat16)  # empty means auto


def test_a_bad_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_dtype.ENV_VAR, "fp8")
    with pytest.raises(ValueError, match=r"ORTHOPTIM_CPU_DTYPE='fp8'.*'float32'.*'bfloat16'"):
        newton_schulz(_gaussian(1, 4, 8))


@pytest.mark.parametrize(("amx", "avx512_bf16", "mkldnn", "expected"), [
    (True, False, True, True), (False, True, True, True), (False, False, True, False), (True, True, False, False)])
def test_native_bf16_matmul_reads_the_cpu(monkeypatch, amx, avx512_bf16, mkldnn, expected):
    """AMX tiles or AVX-512 BF16 make bf16 matmuls native, if oneDNN is there to use them."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: mkldnn)
    cpu_dtype.native_bf16_matmul.cache_clear()
    try:
        assert cpu_dtype.native_bf16_matmul() is expected
    finally:
        cpu_dtype.native_bf16_matmul.cache_clear()


def test_without_onednn_enabled_auto_stays_fp32(auto, monkeypatch):
    auto(True)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert cpu_dtype.iteration_dtype() == torch.float32


def test_a_bad_value_is_refused_when_the_optimizer_is_built(monkeypatch):
    monkeypatch.setenv(cpu_dtype.ENV_VAR, "half")
    with pytest.raises(ValueError, match=r"ORTHOPTIM_CPU_DTYPE='half'"):
        orthoptim.Dion3([torch.nn.Parameter(torch.zeros(4, 4))], lr=0.01)


def test_explicit_dtype_and_float64_inputs_are_kept(auto):
    x = _gaussian(2, 8, 16)
    auto(False)
    fp32_default = newton_schulz(x)
    auto(True)
    assert torch.equal(newton_schulz(x, dtype=torch.float32), fp32_default)  # explicit fp32 wins over auto
    assert not torch.equal(newton_schulz(x), fp32_default)  # bf16 by default now
    x64 = x.double()
    assert torch.equal(newton_schulz(x64), newton_schulz(x64, dtype=torch.float64))
    assert torch.equal(gram_newton_schulz(x64), gram_newton_schulz(x64, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(4, 32, 32), (4, 16, 64), (3, 96, 24)])
def test_bf16_newton_schulz_is_as_close_to_the_polar_factor_as_fp32(shape):
    """Rounding to bf16 adds little to the schedule's own distance from U Vᵀ (~0.1 on Gaussians)."""
    x = _gaussian(*shape, seed=sum(shape))
    exact = exact_polar_batch(x.double())
    fp32 = _rel(newton_schulz(x, dtype=torch.float32), exact)
    bf16 = _rel(newton_schulz(x, dtype=torch.bfloat16), exact)
    assert 0.02 < fp32 < 0.3  # the schedule's own error, so the comparison below means something
    assert abs(bf16 - fp32) < 0.02, (bf16, fp32)
    assert _rel(newton_schulz(x, dtype=torch.bfloat16), newton_schulz(x, dtype=torch.float32)) < 0.03


def _spectrum(kind: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian matrices, or with their singular values reshaped like a momentum's might be."""
    x = _gaussian(*shape, seed=seed, dtype=torch.float64)
    if kind == "gaussian":
        return x.float()
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    r = s.shape[-1]
    if kind == "decaying":
        s = s * torch.logspace(0, -3, r, dtype=torch.float64)
    else:  # low rank plus noise
        s = torch.where(torch.arange(r) < max(r // 8, 1), s * 10, s * 0.01)
    return ((u * s.unsqueeze(-2)) @ vh).float()


def _spiked(batch: int, k: int, seed: int) -> torch.Tensor:
    """k×4k matrices with singular values 1 and k − 1 uniform in (0, 0.1): the second largest ones
    near a tenth of the Frobenius norm, where two Polar Express iterations take them to their peak."""
    gen = torch.Generator().manual_seed(seed)
    u, _, vh = torch.linalg.svd(torch.randn(batch, k, 4 * k, generator=gen, dtype=torch.float64),
                                full_matrices=False)
    s = torch.cat([torch.ones(batch, 1, dtype=torch.float64),
                   0.1 * torch.rand(batch, k - 1, generator=gen, dtype=torch.float64)], dim=1)
    return ((u * s.unsqueeze(-2)) @ vh).float()


def _largest_singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double()).amax(-1)


# A matrix on which Gram NS in bf16 returned entries of 14976 (a polar factor's are at most 1).
BLOWN_UP = torch.tensor([[[0.0472306237, 0.0049326103, -0.0064697666, 0.0045582410],
                          [0.0419064611, -0.0013236525, -0.0131795611, 0.0038041570]]])


# The largest singular value fp16 Gram NS (default restarts) gave in a search over 2×8 inputs: 1.25.
FP16_WORST = torch.tensor([[
    [0.010060696862637997, -0.12245310842990875, 0.062007300555706024, -0.1969405859708786,
     -0.0463792160153389, 0.17710329592227936, 0.3420901894569397, 0.4881485104560852],
    [0.010196514427661896, -0.13412529230117798, 0.06653342396020889, -0.2160062938928604,
     -0.05167961120605469, 0.19289091229438782, 0.3766108453273773, 0.5391561985015869]]])


def test_gram_in_bf16_is_standard_newton_schulz_because_gram_ns_blows_up_there():
    """In bf16 R's small eigenvalues are off by ~2⁻⁸ of the largest, and R ← P R P carries that error
    into the next polynomials: a singular value pushed past their basin grows without bound. Two
    restarts did not prevent it; fp16's three more mantissa bits do (the default on GPUs)."""
    x = _spiked(1000, 4, seed=4)
    gram_ns = partial(gram_newton_schulz, dtype=torch.bfloat16)
    # Why: Gram NS proper in bf16, with the restarts it used to default to, leaves the unit interval
    # (asking for it by restarts= runs it, with a warning).
    with pytest.warns(RuntimeWarning, match=r"restarts=\(2, 4\) runs Gram Newton-Schulz in torch.bfloat16"):
        assert _largest_singular_values(gram_newton_schulz(BLOWN_UP, dtype=torch.bfloat16, restarts=(2, 4))) > 100
        assert int((_largest_singular_values(gram_ns(x, restarts=(2, 4))) > 1.5).sum()) >= 3
    # The default: bf16 standard NS, bit for bit, within the schedule's band (≤ ~1.13) on every input.
    for inputs in (BLOWN_UP, x, _spiked(200, 8, seed=8)):
        assert torch.equal(gram_ns(inputs), newton_schulz(inputs, dtype=torch.bfloat16))
        assert _largest_singular_values(gram_ns(inputs)).max().item() < 1.2
    # fp16 Gram NS (one restart) stays in the band on the same inputs, and near it on the worst input an
    # adversarial search found for it (1.25; 1.12 with a second restart, as standard NS).
    for inputs in (BLOWN_UP, x, _spiked(200, 8, seed=8)):
        assert _largest_singular_values(gram_newton_schulz(inputs, dtype=torch.float16)).max().item() < 1.3
    assert _largest_singular_values(gram_newton_schulz(FP16_WORST, dtype=torch.float16)).item() < 1.4
    assert _largest_singular_values(gram_newton_schulz(FP16_WORST, dtype=torch.float16, restarts=(2, 4))) < 1.15


def test_fp16_gram_without_a_restart_warns_and_is_nan_on_a_rank_one_input():
    x = torch.outer(torch.randn(8, generator=torch.Generator().manual_seed(1)),
                    torch.randn(64, generator=torch.Generator().manual_seed(2)))[None]
    with pytest.warns(RuntimeWarning, match=r"restarts=\(\) runs Gram Newton-Schulz in torch.float16"):
        bare = gram_newton_schulz(x, dtype=torch.float16, restarts=())
    assert not torch.isfinite(bare).all()  # why it warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default restart, and square inputs (standard NS), say nothing
        assert torch.isfinite(gram_newton_schulz(x, dtype=torch.float16)).all()
        gram_newton_schulz(torch.randn(1, 8, 8), dtype=torch.bfloat16, restarts=(2,))


@pytest.mark.parametrize("kind", ["gaussian", "decaying", "low_rank"])
@pytest.mark.parametrize("shape", [(4, 32, 128), (2, 96, 24)], ids=str)
def test_fp16_gram_matches_fp32_standard_newton_schulz(kind, shape):
    """Gram NS in fp16, its GPU dtype, with the published single restart: as close to U Vᵀ as
    standard NS (within 0.01 of fp32 standard NS's distance) on momentum-like spectra."""
    x = _spectrum(kind, shape, seed=3)
    exact = exact_polar_batch(x.double())
    assert _rel(gram_newton_schulz(x, dtype=torch.float16), exact) < _rel(newton_schulz(x), exact) + 0.01


def test_a_dion3_mlp_does_not_diverge_with_bf16_iterations(monkeypatch):
    """A 32-16-16-8 MLP under default Dion3 with bf16 iterations: with Gram NS in bf16 its first step
    moved a matrix by 2.5e4 and the loss ended at 3.4e6."""
    monkeypatch.setenv(cpu_dtype.ENV_VAR, "bfloat16")
    torch.manual_seed(1)
    inputs, targets = torch.randn(128, 32), torch.randn(128, 8)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 8))
    opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.02)
    first = torch.nn.functional.mse_loss(model(inputs), targets).item()
    for _ in range(60):
        before = [p.detach().clone() for p in model.parameters()]
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad()
        moved = max((p.detach() - b).norm().item() for p, b in zip(model.parameters(), before))
        assert moved < 1.0, moved  # lr 0.02 · √(m/n) · ‖orth‖ ≤ ~0.1 for these sizes
    assert torch.nn.functional.mse_loss(model(inputs), targets).item() < first


def test_gram_follows_the_working_dtype(auto):
    x = _gaussian(3, 16, 64)
    auto(True)
    assert torch.equal(gram_newton_schulz(x), newton_schulz(x, dtype=torch.bfloat16))
    with pytest.warns(RuntimeWarning, match="runs Gram Newton-Schulz in torch.bfloat16"):
        gram_proper = gram_newton_schulz(x, dtype=torch.bfloat16, restarts=DEFAULT_RESTARTS)
    assert not torch.equal(gram_newton_schulz(x), gram_proper)
    assert torch.equal(gram_newton_schulz(x, dtype=torch.float16),
                       gram_newton_schulz(x, dtype=torch.float16, restarts=DEFAULT_RESTARTS))
    auto(False)
    assert torch.equal(gram_newton_schulz(x), gram_newton_schulz(x, dtype=torch.float32, restarts=DEFAULT_RESTARTS))


def test_normalize_rounds_the_fp32_quotient_once():
    x = _gaussian(3, 16, 40) * 7.0
    norm = torch.linalg.vector_norm(x.double(), dim=(-2, -1), keepdim=True)
    want = (x.double() / (norm + 1e-7)).to(torch.bfloat16)
    got = normalize(x, torch.bfloat16, 1e-7)
    assert got.dtype == torch.bfloat16
    # fp32 division then one rounding: equal to the rounded exact quotient except at rare ties.
    assert (got != want).float().mean().item() < 1e-3


OPTIMIZERS = {
    "muon": lambda p, orth: orthoptim.Muon(p, lr=0.02, weight_decay=0.1, **orth),
    "normuon": lambda p, orth: orthoptim.NorMuon(p, lr=0.02, **orth),
    "dion2": lambda p, orth: orthoptim.Dion2(p, lr=0.02, fraction=0.5, **orth),
    "dion3": lambda p, orth: orthoptim.Dion3(p, lr=0.02, fraction=0.5, weight_decay=0.1, **orth),
}


def _run(name: str, monkeypatch, env: str, orthogonalizer=None) -> list[torch.Tensor]:
    monkeypatch.setenv(cpu_dtype.ENV_VAR, env)
    shapes = [(24, 24), (24, 24), (48, 24), (24, 96)]
    params = [torch.nn.Parameter(_gaussian(*s, seed=i) * 0.1) for i, s in enumerate(shapes)]
    opt = OPTIMIZERS[name](params, {"orthogonalizer": orthogonalizer} if orthogonalizer else {})
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = _gaussian(*p.shape, seed=100 * step + i)
        opt.step()
    for p in params:
        assert p.dtype == torch.float32 and opt.state[p]["momentum"].dtype == torch.float32
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_under_the_bf16_default(name, monkeypatch):
    """The bf16 default reaches every rule (same steps as an explicit bf16 orthogonalizer), keeps
    parameters and state in fp32, and stays within bf16 rounding of the fp32 steps."""
    start = [(_gaussian(*p.shape, seed=i) * 0.1) for i, p in enumerate(
        [torch.empty(24, 24), torch.empty(24, 24), torch.empty(48, 24), torch.empty(24, 96)])]
    bf16 = _run(name, monkeypatch, "bfloat16")
    default = gram_newton_schulz if name == "dion3" else newton_schulz  # Polar Express coefficients either way
    explicit = _run(name, monkeypatch, "float32", partial(default, dtype=torch.bfloat16))
    fp32 = _run(name, monkeypatch, "float32")
    for b, e, f, s in zip(bf16, explicit, fp32, start):
        torch.testing.assert_close(b, e, rtol=1e-6, atol=1e-6)
        moved = (f - s).norm()
        assert moved > 0
        assert ((b - f).norm() / moved).item() < 0.05  # the update differs by bf16 rounding only


@pytest.mark.parametrize(("env", "expected"), [("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_input_dtype_is_the_dtype_a_named_iteration_rounds_to(monkeypatch, env, expected):
    monkeypatch.setenv(cpu_dtype.ENV_VAR, env)
    x = _gaussian(2, 8, 16)
    for name in ("polar_express", "newton_schulz", "gram"):
        assert input_dtype(name, x) == expected
    assert input_dtype("polar_express", x.double()) == torch.float64
    assert input_dtype("polar_express", x, dtype=torch.float16) is None  # fp16's X Xᵀ would overflow
    assert input_dtype("polar_express", x.double(), dtype=torch.bfloat16) is None  # normalized in fp64 first
    assert input_dtype("svd", x) is None and input_dtype(newton_schulz, x) is None


@pytest.mark.parametrize("nesterov", [False, True])
def test_a_batch_stacked_in_bf16_is_the_rounded_fp32_one(nesterov):
    shapes = [(8, 12)] * 3
    grads = [_gaussian(*s, seed=i) for i, s in enumerate(shapes)]
    momenta = [_gaussian(*s, seed=10 + i) for i, s in enumerate(shapes)]
    copies = [m.clone() for m in momenta]
    fp32 = accumulate_and_stack(copies, grads, 0.9, nesterov)
    bf16 = accumulate_and_stack(momenta, grads, 0.9, nesterov, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert all(torch.equal(m, c) for m, c in zip(momenta, copies))  # the state stays fp32, the same
    assert torch.equal(bf16, fp32.to(torch.bfloat16))
    for i, (s, g, m) in enumerate(zip(shapes, grads, momenta)):  # M ← μM + G, to fp32 rounding
        torch.testing.assert_close(m, _gaussian(*s, seed=10 + i) * 0.9 + g, rtol=1e-6, atol=1e-6)


def test_muon_hands_its_named_iteration_a_bf16_batch(monkeypatch):
    """Under the bf16 default, Muon stacks its momenta in bf16 for a named iteration (no fp32 batch),
    and in fp32 for a user's callable, which gets the momentum's dtype."""
    seen = []
    original = momentum_rules.accumulate_and_stack

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(momentum_rules, "accumulate_and_stack", spy)
    _run("muon", monkeypatch, "bfloat16")
    assert seen and set(seen) == {torch.bfloat16}
    seen.clear()
    _run("muon", monkeypatch, "bfloat16", partial(newton_schulz, dtype=torch.bfloat16))
    assert seen and set(seen) == {torch.float32}
    seen.clear()
    _run("muon", monkeypatch, "float32")
    assert seen and set(seen) == {torch.float32}


@pytest.mark.parametrize("restarts", [(0,), (9,), (0, 5)])
def test_fp16_gram_with_restarts_that_restart_nothing_warns_too(restarts):
    """A restart before iteration 0 or past the last one is no restart: NaN on a rank-1 input as ()."""
    x = torch.outer(torch.randn(8, generator=torch.Generator().manual_seed(1)),
                    torch.randn(64, generator=torch.Generator().manual_seed(2)))[None]
    with pytest.warns(RuntimeWarning, match="runs Gram Newton-Schulz in torch.float16"):
        gram_newton_schulz(x, dtype=torch.float16, restarts=restarts)
