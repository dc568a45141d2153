"""The Triton kernels against float64 references: on a GPU compiled, elsewhere in Triton's CPU interpreter.

Without CUDA, ``TRITON_INTERPRET=1`` is needed twice: when ``triton`` is first imported (it jits its
own library functions then) and when the kernel modules are imported and run. This module sets it for
the import of triton below and again for its own tests (a module fixture), and removes it in between
and afterwards, so other test modules do not see it. Tiles of 16 make small, ragged shapes cross tile
edges. Skipped when triton is not installed.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from orthoptim import kernels
from orthoptim.kernels import select, torch_backend
from orthoptim.orthogonalize import POLAR_EXPRESS, gram_newton_schulz
from tests.test_kernels import (
    HYPER,
    as_list,
    assert_single_rounding,
    dion3_problem,
    dion3_reference,
    ragged_problem,
)

INTERPRET = not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

if INTERPRET and "triton" not in sys.modules:
    with pytest.MonkeyPatch.context() as _mp:
        _mp.setenv("TRITON_INTERPRET", "1")
        triton = pytest.importorskip("triton")
else:
    triton = pytest.importorskip("triton")
if INTERPRET and type(triton.language.zeros).__name__ == "JITFunction":
    pytest.skip(
        "triton was imported without TRITON_INTERPRET=1 earlier in this process; "
        "run this file on its own or with TRITON_INTERPRET=1",
        allow_module_level=True,
    )

F64 = torch.float64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative error of one product, against the largest entry of the float64 result: rounding the
# output (half an ulp: 2⁻¹¹ fp16, 2⁻⁸ bf16) plus fp32 accumulation.
PRODUCT_RTOL = {torch.float32: 2e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}


@pytest.fixture(scope="module", autouse=True)
def tk():
    """The kernel modules, built for the interpreter when there is no GPU (env restored afterwards)."""
    with pytest.MonkeyPatch.context() as mp:
        if INTERPRET:
            mp.setenv("TRITON_INTERPRET", "1")
        mods = {}
        for name in ("triton_common", "triton_symmetric", "triton_dion3"):
            mod = importlib.import_module(f"orthoptim.kernels.{name}")
            if mod.INTERPRET != INTERPRET:  # imported earlier in the other mode
                mod = importlib.reload(mod)
            mods[name] = mod
        assert mods["triton_dion3"].INTERPRET == INTERPRET
        yield SimpleNamespace(sym=mods["triton_symmetric"], dion3=mods["triton_dion3"])


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(sum((i + 1) * ord(c) for i, c in enumerate(repr(key))) % 2**31)


def _symmetric(batch, k, gen) -> torch.Tensor:
    a = torch.randn(batch, k, k, generator=gen, dtype=F64)
    return (a + a.mT) / 2


def _check_product(out: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    """``out`` is exactly symmetric and equals ``exact`` to round-off, up to ``exact``'s own asymmetry
    (a product of symmetric matrices that commute only up to the rounding of the inputs)."""
    assert out.dtype == dtype and out.shape == exact.shape
    assert torch.equal(out, out.mT), "the mirrored result must be exactly symmetric"
    scale = exact.abs().amax(dim=(-2, -1), keepdim=True)
    asymmetry = ((exact - exact.mT) / scale).abs().amax().item()
    err = ((out.cpu().to(F64) - exact) / scale).abs().amax().item()
    assert err <= PRODUCT_RTOL[dtype] + asymmetry, f"relative error {err:.2e} (asymmetry {asymmetry:.1e})"


# Ragged sizes (not multiples of 16), one full tile, several tiles; batch 1 and > 1.
GRAM_SHAPES = [(1, 16, 16), (2, 37, 53), (3, 20, 9), (1, 45, 70)]
SQUARE_SIZES = [(1, 16), (2, 37), (3, 33)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GRAM_SHAPES)
def test_gram(tk, shape, dtype):
    x = torch.randn(*shape, generator=_gen(shape, dtype), dtype=F64).to(dtype)
    exact = x.to(F64) @ x.to(F64).mT
    _check_product(tk.sym.gram(x.to(DEVICE), block=16, block_k=16), exact, dtype)


def test_bf16_results_round_ties_to_even(tk):
    """Rows whose squared norms fall exactly halfway between two bf16 numbers: 1 + 2⁻⁸ (even side
    below: 1) and 1 + 3·2⁻⁸ (even side above: 1 + 2⁻⁶). Rounded as torch rounds, to nearest even
    (the interpreter's own conversion truncates; rounding half up or down would miss one of them)."""
    x = torch.zeros(1, 2, 16, dtype=torch.bfloat16)
    x[0, :, 0] = 1.0
    x[0, 0, 1] = 2.0**-4
    x[0, 1, 1:4] = 2.0**-4
    exact = x.to(F64) @ x.to(F64).mT  # fp32 holds these sums exactly
    assert exact[0, 0, 0].item() == 1 + 2.0**-8 and exact[0, 1, 1].item() == 1 + 3 * 2.0**-8
    out = tk.sym.gram(x.to(DEVICE), block=16, block_k=16).cpu()
    assert torch.equal(out, exact.to(torch.bfloat16))
    assert out[0, 0, 0].item() == 1.0 and out[0, 1, 1].item() == 1 + 2.0**-6


def test_gram_strided_input(tk):
    """A transposed (column-major) batch is read through its strides."""
    x = torch.randn(2, 40, 27, generator=_gen("strided"), dtype=F64)
    xt = x.to(torch.float32).to(DEVICE).mT  # [2, 27, 40], not contiguous
    _check_product(tk.sym.gram(xt, block=16, block_k=16), x.mT @ x, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SQUARE_SIZES)
def test_symmetric_polynomial(tk, size, dtype):
    batch, k = size
    r = _symmetric(batch, k, _gen("poly", size, dtype)).to(dtype)
    r64 = r.to(F64)
    a, b, c = POLAR_EXPRESS[1]
    exact = a * torch.eye(k, dtype=F64) + b * r64 + c * r64 @ r64
    _check_product(tk.sym.symmetric_polynomial(r.to(DEVICE), a, b, c, block=16, block_k=16), exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SQUARE_SIZES)
def test_symmetric_product_of_commuting_matrices(tk, size, dtype):
    batch, k = size
    r = _symmetric(batch, k, _gen("prod", size, dtype)) / k**0.5
    p = 1.5 * torch.eye(k, dtype=F64) - 0.5 * r @ r  # a polynomial in r: commutes with it
    p, r = p.to(dtype), r.to(dtype)
    exact = r.to(F64) @ p.to(F64)
    _check_product(tk.sym.symmetric_product(r.to(DEVICE), p.to(DEVICE), block=16, block_k=16), exact, dtype)


def test_symmetric_product_is_the_same_for_every_tile_size(tk):
    """For P, Q that do not commute, P Q is not symmetric: the kernel returns its lower triangle,
    mirrored, bit-equal whatever the tile (autotuning may choose another one in each process)."""
    gen = _gen("tiles")
    p, q = (_symmetric(2, 45, gen).to(torch.float32).to(DEVICE) for _ in range(2))
    small = tk.sym.symmetric_product(p, q, block=16, block_k=16)
    large = tk.sym.symmetric_product(p, q, block=32, block_k=16)
    assert torch.equal(small, large)
    exact = torch.tril(p.cpu().to(F64) @ q.cpu().to(F64))
    exact = exact + torch.tril(exact, -1).mT
    torch.testing.assert_close(small.cpu().to(F64), exact, rtol=0, atol=1e-4)
    # In the interpreter the depth of a K step orders the fp32 sums, so it changes bits: every autotuned
    # config has one. (Compiled, an fp32 tl.dot is one FMA chain per element across K steps, the same
    # bits at any depth, so there is nothing to assert on a GPU.)
    if INTERPRET:
        assert not torch.equal(small, tk.sym.symmetric_product(p, q, block=16, block_k=32))
    assert {c.kwargs["BLOCK_K"] for c in tk.sym._autotune_configs()} == {tk.sym.AUTOTUNE_BLOCK_K}


AUTOTUNED_BLOCKS = [64, 128]


@pytest.mark.parametrize("block", AUTOTUNED_BLOCKS)
def test_the_autotuned_tile_shapes_on_ragged_sizes(tk, block):
    """The tiles autotuning may pick on a GPU (64 or 128 rows, 64 deep), each on a size that ends
    mid-tile in both directions, with a depth that ends mid-step: X Xᵀ, the transposed read of a tall
    X (Xᵀ X), and a polynomial that reads C."""
    assert sorted({c.kwargs["BLOCK"] for c in tk.sym._autotune_configs()}) == AUTOTUNED_BLOCKS
    depth = tk.sym.AUTOTUNE_BLOCK_K
    gen = _gen("autotuned", block)
    k, n = block + 3, 2 * depth + 5
    x = torch.randn(2, k, n, generator=gen, dtype=F64)
    _check_product(tk.sym.gram(x.to(torch.float32).to(DEVICE), block=block, block_k=depth), x @ x.mT, torch.float32)
    tall = torch.randn(2, n, k, generator=gen, dtype=F64)  # Xᵀ X: rows read with stride ≠ 1 along K
    got = tk.sym.gram(tall.to(torch.float32).to(DEVICE).mT, block=block, block_k=depth)
    _check_product(got, tall.mT @ tall, torch.float32)
    r = _symmetric(2, k, gen) / k**0.5
    got = tk.sym.symmetric_polynomial(r.to(torch.float32).to(DEVICE), 2.0, -1.5, 0.5, block=block, block_k=depth)
    _check_product(got, 2 * torch.eye(k, dtype=F64) - 1.5 * r + 0.5 * r @ r, torch.float32)


def test_larger_batches_than_one_grid_launch_in_chunks(tk, monkeypatch):
    """CUDA caps grid dimension 1 (the batch) at 65535: a larger batch runs in several launches."""
    monkeypatch.setattr(tk.sym, "MAX_GRID_BATCH", 2)
    x = torch.randn(5, 20, 33, generator=_gen("chunks"), dtype=F64)
    r = _symmetric(5, 20, _gen("chunks-r"))
    _check_product(tk.sym.gram(x.to(torch.float32).to(DEVICE), block=16), x @ x.mT, torch.float32)
    exact = 2 * torch.eye(20, dtype=F64) - r + 0.5 * r @ r
    got = tk.sym.symmetric_polynomial(r.to(torch.float32).to(DEVICE), 2.0, -1.0, 0.5, block=16)
    _check_product(got, exact, torch.float32)


@pytest.mark.parametrize("block", [8, 24, 0])
def test_tile_sizes_must_be_powers_of_two_from_16(tk, block):
    x = torch.randn(1, 20, 20).to(DEVICE)
    with pytest.raises(ValueError, match="power of two >= 16"):
        tk.sym.gram(x, block=block if block else 16, block_k=block or 12)


def test_tf32_follows_either_torch_api(tk):
    """fp32 inputs use TF32 exactly when torch allows it, set through the legacy flag or the
    fp32_precision settings of torch >= 2.9 (once those are set, reading the legacy flag raises)."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("torch < 2.9 has only the legacy allow_tf32 flag")
    saved = matmul.fp32_precision, torch.backends.fp32_precision
    try:
        assert tk.sym._precision(torch.bfloat16) == "tf32"  # 16-bit inputs: the argument is unused
        for local, overall, expected in [("ieee", "none", "ieee"), ("tf32", "none", "tf32"),
                                         ("none", "tf32", "tf32"), ("none", "ieee", "ieee"), ("ieee", "tf32", "ieee")]:
            torch.backends.fp32_precision = overall
            matmul.fp32_precision = local
            assert tk.sym._precision(torch.float32) == expected, (local, overall)
        torch.backends.fp32_precision, matmul.fp32_precision = "none", "none"
        torch.set_float32_matmul_precision("high")
        assert tk.sym._precision(torch.float32) == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert tk.sym._precision(torch.float32) == "ieee"
    finally:
        torch.backends.fp32_precision = saved[1]
        matmul.fp32_precision = saved[0]


def test_autotune_tries_only_configs_that_fit_in_shared_memory(tk):
    """Hopper has 227 KiB of shared memory per block: every config fits 16-bit inputs; for fp32 the
    ones whose double-size buffers cannot fit are dropped before compiling (seconds each, then fail)."""
    configs = tk.sym._autotune_configs()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kept = tk.sym._fits_in_shared_memory(configs, {"a_ptr": torch.empty(1, dtype=dtype)})
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for c in configs:
            need = c.num_stages * 2 * c.kwargs["BLOCK"] * c.kwargs["BLOCK_K"] * itemsize
            assert (c in kept) == (need <= 227 * 1024), (dtype, c)
        if dtype != torch.float32:
            assert len(kept) == len(configs)
        else:
            assert 0 < len(kept) < len(configs)


@pytest.mark.skipif(INTERPRET, reason="autotuned tile shapes are for the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autotuned_shapes_on_gpu(tk, dtype):
    x = torch.randn(3, 300, 1000, generator=_gen("gpu", dtype), dtype=F64).to(dtype)
    _check_product(tk.sym.gram(x.to(DEVICE)), x.to(F64) @ x.to(F64).mT, dtype)
    r = _symmetric(2, 513, _gen("gpu-r", dtype)).to(dtype)
    r64 = r.to(F64)
    exact = 2 * torch.eye(513, dtype=F64) - r64 + 0.5 * r64 @ r64
    _check_product(tk.sym.symmetric_polynomial(r.to(DEVICE), 2.0, -1.0, 0.5), exact, dtype)


def test_gram_newton_schulz_through_the_triton_backend(tk, monkeypatch):
    """Gram NS with every k×k product in Triton equals the torch backend (fp32, ragged k, batch 2)."""
    x = torch.randn(2, 21, 50, generator=_gen("gns"), dtype=F64).to(torch.float32).to(DEVICE)
    monkeypatch.setenv(select.ENV_VAR, "torch")
    expected = gram_newton_schulz(x, dtype=torch.float32)
    monkeypatch.setenv(select.ENV_VAR, "triton")
    assert kernels.backend(x) == "triton"
    got = gram_newton_schulz(x, dtype=torch.float32)
    err = (got.to(F64) - expected.to(F64)).abs().amax().item()
    assert err <= 1e-4, f"max |triton − torch| = {err:.2e}"


# ----------------------------------------------------------------------------- fused Dion3 update
DION3_CASES = [
    # batch, m, n, k, layout
    (3, 37, 45, 10, "list"),
    (2, 20, 70, 20, "tensor"),  # every row selected
    (1, 50, 33, 17, "colmajor"),
]


def _run_dion3(tk, params, index, o, v, hyper, normalize=True):
    dev = [p.to(DEVICE) for p in as_list(params)] if not isinstance(params, torch.Tensor) else params.to(DEVICE)
    if not isinstance(params, torch.Tensor) and params[0].stride() != params[0].contiguous().stride():
        dev = [p.to(DEVICE).mT.contiguous().mT for p in params]  # keep the column-major layout
    v_dev = v.to(DEVICE) if normalize else None
    v_new = tk.dion3.dion3_post_update(dev, index.to(DEVICE), o.to(DEVICE), v_dev, normalize=normalize, **hyper)
    return [p.cpu() for p in as_list(dev)], (v_new.cpu() if v_new is not None else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DION3_CASES)
def test_dion3_post_update_kernel(tk, case, dtype):
    batch, m, n, k, layout = case
    params, index, o, v = dion3_problem(batch, m, n, k, dtype, seed=m + n, layout=layout)
    before = [p.clone() for p in as_list(params)]
    exact_x, exact_v = dion3_reference(before, index, o, v, **HYPER)
    got_x, got_v = _run_dion3(tk, params, index, o, v, HYPER)
    torch.testing.assert_close(got_v.to(F64), exact_v, rtol=1e-5, atol=0)
    for x, ref, old in zip(got_x, exact_x, before):
        if dtype == torch.float32:
            torch.testing.assert_close(x.to(F64), ref, rtol=1e-5, atol=1e-8)
        else:  # one rounding to the parameter dtype
            assert_single_rounding(x, ref, old.to(F64).abs() + (ref - old.to(F64)).abs())
    # And the torch reference: the same numbers in fp32 (in half precision both round once, and the
    # check above is the stronger one).
    if dtype == torch.float32:
        ref_params = [p.clone() for p in before]
        torch_backend.dion3_post_update(ref_params, index, o, v, **HYPER)
        for x, ref in zip(got_x, ref_params):
            torch.testing.assert_close(x, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("normalize", [True, False])
def test_dion3_post_update_kernel_without_weight_decay(tk, normalize):
    """wd = 0 takes the selected-rows-only path: other rows stay bit-equal."""
    params, index, o, v = dion3_problem(2, 40, 36, 7, torch.bfloat16, seed=5, layout="list")
    hyper = {**HYPER, "weight_decay": 0.0}
    before = [p.clone() for p in params]
    exact_x, _ = dion3_reference(before, index, o, v, normalize=normalize, **hyper)
    got_x, got_v = _run_dion3(tk, params, index, o, v, hyper, normalize=normalize)
    assert (got_v is None) == (not normalize)
    for b, (x, ref, old) in enumerate(zip(got_x, exact_x, before)):
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[index[b]] = False
        assert torch.equal(x[untouched], old[untouched])
        assert_single_rounding(x, ref, old.to(F64).abs() + (ref - old.to(F64)).abs())


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("normalize", [True, False])
def test_dion3_post_update_kernel_ragged_index(tk, normalize, weight_decay):
    """A ragged selection: index tensors of different lengths (one empty), O and V zero-padded."""
    params, index, o, v = ragged_problem(21, 40, [9, 0, 17], torch.float32, seed=7)
    hyper = {**HYPER, "weight_decay": weight_decay}
    exact_x, exact_v = dion3_reference(params, index, o, v, normalize=normalize, **hyper)
    dev = [p.to(DEVICE) for p in params]
    v_dev = v.to(DEVICE) if normalize else None
    v_new = tk.dion3.dion3_post_update(
        dev, [i.to(DEVICE) for i in index], o.to(DEVICE), v_dev, normalize=normalize, **hyper
    )
    for b, (x, ref) in enumerate(zip(dev, exact_x)):
        torch.testing.assert_close(x.cpu().to(F64), ref, rtol=1e-5, atol=1e-8)
        if normalize:
            torch.testing.assert_close(v_new[b, : len(index[b])].cpu().to(F64), exact_v[b], rtol=1e-5, atol=0)


@pytest.mark.parametrize(("batch", "m", "n", "k"), [(2, 70, 300, 40), (1, 1100, 8, 1030)])
def test_dion3_post_update_kernel_with_the_gpus_tile_sizes(tk, monkeypatch, batch, m, n, k):
    """The interpreter runs smaller tiles than a GPU; here the GPU's (32 rows, 128 columns, 1024 rows
    of statistics), on sizes that end mid-tile: 3 column tiles, and more selected rows than one
    statistics block."""
    if INTERPRET:
        monkeypatch.setattr(tk.dion3, "BLOCK_ROWS", 32)
        monkeypatch.setattr(tk.dion3, "BLOCK_COLS", 128)
        monkeypatch.setattr(tk.dion3, "STATS_BLOCK", 1024)
    params, index, o, v = dion3_problem(batch, m, n, k, torch.float32, seed=m)
    before = [p.clone() for p in as_list(params)]
    exact_x, exact_v = dion3_reference(before, index, o, v, **HYPER)
    got_x, got_v = _run_dion3(tk, params, index, o, v, HYPER)
    torch.testing.assert_close(got_v.to(F64), exact_v, rtol=1e-5, atol=0)
    for x, ref in zip(got_x, exact_x):
        torch.testing.assert_close(x.to(F64), ref, rtol=1e-5, atol=1e-8)


def test_dion3_post_update_kernel_zero_update(tk):
    """O = 0 for one matrix: its selected rows are only decayed (0/0 stays 0), no NaN."""
    params, index, o, v = dion3_problem(2, 18, 20, 5, torch.float32, seed=9, layout="tensor")
    o[1].zero_()
    exact_x, exact_v = dion3_reference(list(params.unbind(0)), index, o, v, **HYPER)
    got_x, got_v = _run_dion3(tk, params, index, o, v, HYPER)
    for x, ref in zip(got_x, exact_x):
        torch.testing.assert_close(x.to(F64), ref, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(got_v.to(F64), exact_v, rtol=1e-5, atol=0)


def test_dion3_dispatch(tk, monkeypatch):
    """kernels.dion3_post_update takes the kernel under ORTHOPTIM_KERNELS=triton, and falls back to
    torch for a list of mixed layouts, with the same result either way."""
    monkeypatch.setenv(select.ENV_VAR, "triton")
    params, index, o, v = dion3_problem(2, 19, 24, 6, torch.float32, seed=2, layout="list")
    params = [p.to(DEVICE) for p in params]
    params[1] = params[1].mT.contiguous().mT  # a different layout: not one launch
    assert not tk.dion3.supported(params)
    exact_x, _ = dion3_reference([p.cpu() for p in params], index, o, v, **HYPER)
    kernels.dion3_post_update(params, index.to(DEVICE), o.to(DEVICE), v.to(DEVICE), **HYPER)
    for x, ref in zip(params, exact_x):
        torch.testing.assert_close(x.cpu().to(F64), ref, rtol=1e-5, atol=1e-8)
    same = [p.contiguous() for p in params]
    assert tk.dion3.supported(same)
    assert kernels._dion3_triton(same, index.to(DEVICE), o.to(DEVICE), v.to(DEVICE), True)


def test_the_gpu_checks_triton_probe_launches_a_kernel(tk):
    """benchmarks/triton_probe.py, which gpu_check.sh runs first (a file: @triton.jit reads its source)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_probe.py"
    spec = importlib.util.spec_from_file_location("triton_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.probe(DEVICE) == "ok"


def test_the_triton_dion3_update_of_a_zero_row_with_a_tiny_epsilon_is_torchs(tk):
    params, index, o, v = dion3_problem(1, 12, 10, 4, torch.float32, seed=9)
    o[0, 1] = 0
    v[0, 1] = 0
    hyper = {**HYPER, "eps": 1e-30}
    expected = [p.clone() for p in params]
    expected_v = torch_backend.dion3_post_update(expected, index, o, v.clone(), normalize=True, **hyper)
    moved = [p.to(DEVICE) for p in params]
    got_v = tk.dion3.dion3_post_update(moved, index.to(DEVICE), o.to(DEVICE), v.to(DEVICE), normalize=True, **hyper)
    assert all(torch.isfinite(p).all() for p in moved)
    for p, e in zip(moved, expected):
        torch.testing.assert_close(p.cpu(), e, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got_v.cpu(), expected_v)
