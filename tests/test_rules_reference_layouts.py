"""Matrix layouts and megabatching against the per-matrix reference in ``reference_rules.py``.

3-D parameters (a batch of matrices), ``num_heads`` (each head's row block its own matrix, with its
own lr scale), ``split_sizes`` (fused blocks), ``flatten`` (conv weights) and groups mixing shapes:
each matrix must be updated exactly as if it were a parameter of its own. Megabatching: one
orthogonalizer call per distinct block shape per step. Finally the default (Newton-Schulz) path.
"""

from __future__ import annotations

import pytest
import torch

import orthoptim
from tests import reference_rules as ref

F64 = torch.float64
CLASSES = {"muon": orthoptim.Muon, "normuon": orthoptim.NorMuon, "dion2": orthoptim.Dion2,
           "dion3": orthoptim.Dion3, "dion": orthoptim.Dion}
ALGORITHMS = list(CLASSES)
# fraction 0.5 and rank_fraction 0.5 keep k and r ≥ 2 on the small blocks below.
HP = {**ref.HP, "fraction": 0.5, "rank_fraction": 0.5}


def run(algorithm, shapes, seed, steps=4, orthogonalizer=None, **group_opts):
    params = ref.make_params(shapes, seed=seed)
    opt, reference = ref.build(CLASSES[algorithm], algorithm, params, HP, orthogonalizer=orthogonalizer,
                               **group_opts)
    ref.drive(opt, reference, seed=seed, steps=steps)
    return opt, reference


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_3d_parameters_are_batches_of_matrices(algorithm):
    run(algorithm, [(3, 8, 12), (2, 12, 8)], seed=21)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("shape", "heads"), [((24, 16), 3), ((24, 6), 2), ((2, 12, 10), 2)],
                         ids=["wide-heads", "tall-heads", "3d-heads"])
def test_num_heads(algorithm, shape, heads):
    """Each head's rows are their own matrix with s(rows/heads, cols) — not s(rows, cols)."""
    run(algorithm, [shape], seed=22, num_heads=heads)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_split_sizes(algorithm):
    """Fused blocks of different shapes: 16×8 (tall: Dion2 selects columns) and two 4×8 (wide: rows)."""
    run(algorithm, [(24, 8), (24, 8)], seed=23, split_sizes=[16, 4, 4])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_split_sizes_with_num_heads(algorithm):
    """Heads inside each split: [8, 4, 4] rows with 2 heads → blocks of 4, 4, 2, 2, 2, 2 rows."""
    run(algorithm, [(16, 12)], seed=24, split_sizes=[8, 4, 4], num_heads=2)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("shapes", "opts"), [
    ([(12, 8), (8, 20)], {}),  # stored [in, out]: GPT-2's Conv1D
    ([(3, 8, 12)], {}),  # experts stored [E, in, out]
    ([(12, 8)], {"split_sizes": [4, 4]}),  # the transposed matrix's 8 rows cut in two
    ([(6, 2, 2, 2)], {"flatten": True}),  # a transposed conv [in, out, kh, kw] → [out·kh·kw, in]
], ids=["2d", "3d", "split", "conv-transpose"])
def test_transpose(algorithm, shapes, opts):
    """Each stored matrix read transposed: rows are the stored columns (lr scale, row selection and
    per-row normalization by them), and the update lands back in the stored layout."""
    run(algorithm, shapes, seed=27, transpose=True, **opts)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_flatten_conv_weight(algorithm):
    """Conv weights [out, in, kh, kw] are the matrix [out, in·kh·kw]."""
    run(algorithm, [(8, 3, 3, 3), (16, 2, 3, 1)], seed=25, flatten=True)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_group_mixing_shapes(algorithm):
    """Several shapes, several parameters of one shape, a 3-D parameter, all in one group."""
    run(algorithm, [(16, 24), (12, 24), (16, 24), (24, 16), (2, 16, 24), (16, 24), (24, 16)], seed=26)


# ----------------------------------------------------------------------------- megabatching
def _expected_batches(algorithm, blocks):
    """The [B, k, n] each orthogonalizer call should see, from {(rows, cols): number of matrices}."""
    out = []
    for (m, n), count in blocks.items():
        if algorithm in ("muon", "normuon"):
            out.append((count, m, n))
        elif algorithm == "dion3":
            out.append((count, ref.ceil_fraction(HP["fraction"], m), n))
        elif m <= n:  # dion2, rows
            out.append((count, ref.ceil_fraction(HP["fraction"], m), n))
        else:  # dion2, columns
            out.append((count, m, ref.ceil_fraction(HP["fraction"], n)))
    return sorted(out)


@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2", "dion3"])
@pytest.mark.parametrize(
    ("shapes", "opts", "blocks"),
    [
        ([(16, 24), (16, 24), (24, 16), (2, 16, 24), (8, 24), (24, 16), (16, 24)], {},
         {(16, 24): 5, (24, 16): 2, (8, 24): 1}),
        ([(16, 24), (32, 24), (16, 24)], {"num_heads": 2}, {(8, 24): 4, (16, 24): 2}),
    ],
    ids=["shapes", "heads"],
)
def test_one_orthogonalizer_call_per_block_shape(algorithm, shapes, opts, blocks):
    counter = ref.CountingPolar()
    steps = 3
    run(algorithm, shapes, seed=27, steps=steps, orthogonalizer=counter, **opts)
    want = _expected_batches(algorithm, blocks)
    assert len(counter.shapes) == steps * len(blocks), f"calls: {counter.shapes}"
    for t in range(steps):
        got = sorted(counter.shapes[t * len(blocks) : (t + 1) * len(blocks)])
        assert got == want, f"step {t + 1}: batches {got}, expected {want}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_matrices_of_one_shape_but_two_dtypes_step_as_in_groups_of_their_own(algorithm):
    """A bf16 and an fp32 matrix of one shape in one group form two megabatches (keyed by dtype too):
    bit for bit the steps of the same matrices in separate groups. One batch of both stacks them in
    one dtype: a dtype error, or (NorMuon) the fp32 matrix computed in bf16."""
    gen = torch.Generator().manual_seed(31)
    init = [torch.randn(16, 32, generator=gen).to(dtype) for dtype in (torch.bfloat16, torch.float32)]
    grads = [[torch.randn(16, 32, generator=gen).to(t.dtype) for t in init] for _ in range(3)]
    together = [t.clone().requires_grad_() for t in init]
    apart = [t.clone().requires_grad_() for t in init]
    opt_together = orthoptim.Dion3([{"params": together, "algorithm": algorithm}], lr=0.1)
    opt_apart = orthoptim.Dion3([{"params": [p], "algorithm": algorithm} for p in apart], lr=0.1)
    for step in grads:
        for p, q, g in zip(together, apart, step):
            p.grad, q.grad = g.clone(), g.clone()
        opt_together.step()
        opt_apart.step()
    for p, q in zip(together, apart):
        assert p.dtype == q.dtype
        assert torch.equal(p.detach(), q.detach()), f"{p.dtype} matrix differs from its own group's step"


# ----------------------------------------------------------------------------- the default orthogonalizers
DEFAULT_ORTHOGONALIZER = {"muon": "polar_express", "normuon": "polar_express", "dion2": "polar_express",
                          "dion3": "gram"}
# Polar Express (5 iterations) lands within a few percent of the polar factor on these random
# matrices (measured 2–8 % in ‖·‖_F); an update that skipped or botched orthogonalization is off by O(1).
DEFAULT_TOL = 0.15


@pytest.mark.parametrize("algorithm", ["muon", "normuon", "dion2", "dion3"])
def test_default_orthogonalizer_close_to_exact(algorithm):
    """fp32, one step: the default path (Newton-Schulz / Gram NS) against the exact-SVD run."""
    shapes = [(32, 64), (64, 32), (16, 128)]
    cls = CLASSES[algorithm]
    kwargs = {k: HP[k] for k in ref.CLASS_ARGS[algorithm]}
    default_params = ref.make_params(shapes, seed=28, dtype=torch.float32)
    exact_params = [p.detach().clone().requires_grad_() for p in default_params]
    default = cls(default_params, **kwargs)
    assert default.param_groups[0]["orthogonalizer"] == DEFAULT_ORTHOGONALIZER[algorithm]
    exact = cls(exact_params, **kwargs, orthogonalizer=ref.exact_polar_batch)
    gen = torch.Generator().manual_seed(28)
    x0 = [p.detach().clone() for p in default_params]
    for p, q in zip(default_params, exact_params):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
    default.step()
    exact.step()
    for p, q, x in zip(default_params, exact_params, x0):
        err = float((p.detach() - q.detach()).norm() / (q.detach() - x).norm())
        assert err <= DEFAULT_TOL, f"{tuple(p.shape)}: default update off the exact one by {err:.3g} (relative)"


def test_dion_float32_close_to_float64_reference():
    """Dion has no orthogonalizer option: its fp32 run (Cholesky-QR) against the float64 reference."""
    shapes = [(32, 64), (64, 32)]
    params = ref.make_params(shapes, seed=29, dtype=torch.float32)
    opt, reference = ref.build(orthoptim.Dion, "dion", params, HP)
    ref.drive(opt, reference, seed=29, steps=3, tol_x=1e-4, tol_state=1e-4)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transpose_with_the_default_orthogonalizer_equals_the_stored_transpose(algorithm, dtype):
    """The library's own iterations (Muon's last product fused into the parameter update, Dion3's
    fused post-update) on [in, out] weights read transposed: as on the same weights stored [out, in]."""
    gen = torch.Generator().manual_seed(28)
    stored = [torch.randn(s, generator=gen).to(dtype) for s in [(24, 16), (3, 16, 24)]]
    grads = [[torch.randn(s.shape, generator=gen).to(dtype) for s in stored] for _ in range(3)]
    a = [t.clone().requires_grad_() for t in stored]
    b = [t.mT.contiguous().requires_grad_() for t in stored]
    opt_a = CLASSES[algorithm]([{"params": a, "transpose": True}], lr=0.02, weight_decay=0.1)
    opt_b = CLASSES[algorithm](b, lr=0.02, weight_decay=0.1)
    for step in grads:
        for p, q, g in zip(a, b, step):
            p.grad, q.grad = g.clone(), g.mT.contiguous()
        opt_a.step()
        opt_b.step()
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach().mT, q.detach(), rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6 if dtype == torch.float32 else 1e-2)
