"""Slice selection for Dion2 / Dion3 (rules/selection.py) against float64 references.

The CPU path of ``l1_norms`` forms |M| block by block in a small scratch; these tests shrink the
block so that a few rows span many blocks with a ragged last one, and also run the default size
on a matrix bigger than one block.
"""

from __future__ import annotations

import pytest
import torch

from orthoptim.rules import selection

F64 = torch.float64


def matrices(shape, count, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=F64).to(dtype) for _ in range(count)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("chunk", [64, None], ids=["small-blocks", "default-blocks"])
def test_l1_norms_match_float64(monkeypatch, dtype, dim, chunk):
    if chunk is not None:
        monkeypatch.setattr(selection, "L1_CHUNK_ELEMENTS", chunk)  # 6 rows of 10 per block: 23 = 3·6 + 5
    shape = (23, 10) if chunk is not None else (300, 700)  # default: 93 rows per block, the last one 21
    ms = matrices(shape, 3, dtype)
    got = selection.l1_norms(ms, dim)
    exact = torch.stack([m.to(F64).abs().sum(dim=1 - dim) for m in ms])
    assert got.shape == exact.shape
    assert got.dtype == torch.promote_types(dtype, torch.float32)  # accumulated in fp32 at least
    tol = 1e-12 if dtype == F64 else 1e-6
    torch.testing.assert_close(got.to(F64), exact, rtol=tol, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, F64])
@pytest.mark.parametrize("shape", [(23, 10), (0, 10), (7, 0)], ids=str)
def test_accumulate_and_row_norms_equal_the_two_steps(monkeypatch, dtype, shape):
    """M ← M + G with the rows' L1 norms in one pass (blocks of 6 rows: 23 = 3·6 + 5) gives what the
    sum followed by l1_norms gives, bit for bit, and the float64 norms of the new M to rounding."""
    monkeypatch.setattr(selection, "L1_CHUNK_ELEMENTS", 64)
    momenta, grads = matrices(shape, 3, dtype, seed=2), matrices(shape, 3, dtype, seed=3)
    copies = [m.clone() for m in momenta]
    norms = selection.accumulate_and_row_norms_(momenta, grads)
    torch._foreach_add_(copies, grads)
    assert all(torch.equal(m, c) for m, c in zip(momenta, copies))
    assert torch.equal(norms, selection.l1_norms(copies, 0))
    exact = torch.stack([m.to(F64).abs().sum(dim=1) for m in copies]) if shape[0] else torch.zeros(3, 0, dtype=F64)
    torch.testing.assert_close(norms.to(F64), exact, rtol=1e-12 if dtype == F64 else 1e-6, atol=0)


def test_l1_norms_of_strided_views_and_empty_shards(monkeypatch):
    monkeypatch.setattr(selection, "L1_CHUNK_ELEMENTS", 16)
    base = matrices((9, 13), 2, torch.float32, seed=1)
    views = [b.mT for b in base]  # [13, 9], not contiguous
    exact = torch.stack([v.to(F64).abs().sum(dim=1) for v in views])
    torch.testing.assert_close(selection.l1_norms(views, 0).to(F64), exact, rtol=1e-6, atol=0)
    empty = [torch.empty(0, 5), torch.empty(0, 5)]  # a rank that holds no rows of these matrices
    assert selection.l1_norms(empty, 0).shape == (2, 0)
    assert torch.equal(selection.l1_norms(empty, 1), torch.zeros(2, 5))


@pytest.mark.parametrize("dim", [0, 1])
def test_top_slices_are_the_largest_l1_norms(monkeypatch, dim):
    monkeypatch.setattr(selection, "L1_CHUNK_ELEMENTS", 32)
    ms = matrices((40, 24), 2, torch.float32, seed=2)
    k = 7
    index = selection.top_slices(ms, k, dim)
    for m, chosen in zip(ms, index):
        norms = m.to(F64).abs().sum(dim=1 - dim)
        expected = set(torch.topk(norms, k).indices.tolist())
        assert set(chosen.tolist()) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_decay_slices_scales_only_the_selected_slices(dtype, dim):
    ms = matrices((12, 9), 2, dtype, seed=3)
    before = [m.clone() for m in ms]
    index = torch.tensor([[0, 5, 8], [2, 3, 7]])
    mu = 0.95
    current = selection.gather_slices(ms, index, dim)
    selection.decay_slices_(ms, index, current, dim, mu)
    eps = torch.finfo(dtype).eps
    for m, old, chosen in zip(ms, before, index):
        picked = torch.zeros(m.shape[dim], dtype=torch.bool)
        picked[chosen] = True
        m_, old_ = (m, old) if dim == 0 else (m.mT, old.mT)
        exact = mu * old_[picked].to(F64)
        # Within two roundings of μ·M (M + (μ−1)·M); untouched slices bit-equal.
        torch.testing.assert_close(m_[picked].to(F64), exact, rtol=2 * eps, atol=0)
        assert torch.equal(m_[~picked], old_[~picked])


def test_decay_slices_with_a_ragged_index():
    """A list of index tensors of different lengths (a row shard under exact global selection)."""
    ms = matrices((6, 4), 2, torch.float32, seed=4)
    before = [m.clone() for m in ms]
    index = [torch.tensor([1, 4]), torch.tensor([], dtype=torch.long)]
    current = selection.gather_slices(ms, index, 0)  # zero-padded to the longest
    selection.decay_slices_(ms, index, current, 0, 0.5)
    torch.testing.assert_close(ms[0][[1, 4]], 0.5 * before[0][[1, 4]], rtol=2e-7, atol=0)
    assert torch.equal(ms[0][[0, 2, 3, 5]], before[0][[0, 2, 3, 5]])
    assert torch.equal(ms[1], before[1])


@pytest.mark.parametrize(("fraction", "size", "k"), [
    (0.3, 20, 6),             # 0.3 · 20 = 6.000000000000001 in floats: 7 without the exact product
    (0.1, 10, 1),             # the float 0.1 is a hair above 1/10
    (0.1250000001, 8, 2),     # a hair above an integer is the next one (a tolerance made it 1)
    (1 / 3, 3, 1), (0.25, 768, 192), (1, 5, 5), (1e-6, 4096, 1), (0.7, 10, 7),
    (5 / 6, 6, 5), (5 / 6, 768, 640), (5 / 12, 12, 5), (7 / 12, 1536, 896), (5 / 9, 9, 5),  # written as divisions
    (1 / 16, 768, 48), (1 / 64, 4096, 64), (2 / 3, 3, 2),
])
def test_the_selected_count_is_the_exact_ceiling_of_the_decimal_fraction(fraction, size, k):
    assert selection.ceil_fraction(fraction, size) == k
    assert selection.num_selected(size, fraction) == k


def test_a_fraction_a_hair_above_a_slice_count_selects_one_more_row_and_rank():
    import orthoptim

    p = torch.nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    before = p.detach().clone()
    opt = orthoptim.Dion3([p], lr=0.1, fraction=0.1250000001, weight_decay=0.0)
    p.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    opt.step()
    assert int((p.detach() != before).any(dim=1).sum()) == 2  # ceil(1.0000000008) rows updated

    q = torch.nn.Parameter(torch.randn(8, 8))
    dion = orthoptim.Dion([q], lr=0.1, rank_fraction=0.1250000001)
    q.grad = torch.randn(8, 8)
    dion.step()
    assert dion.state[q]["Q"].shape[-1] == 2


def test_the_selected_count_is_the_fewest_slices_whose_float_share_reaches_the_fraction():
    gen = torch.Generator().manual_seed(11)
    sizes = torch.randint(1, 5000, (3000,), generator=gen).tolist()
    numerators = torch.randint(1, 64, (3000,), generator=gen).tolist()
    for size, num in zip(sizes, numerators):
        for fraction in (num / 64, min(1.0, num / 37), float(torch.rand((), generator=gen)) or 0.5):
            k = selection.ceil_fraction(fraction, size)
            assert k / size >= fraction and (k == 0 or (k - 1) / size < fraction), (fraction, size, k)
