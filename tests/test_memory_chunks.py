"""Single-process megabatches are orthogonalized in parts: same update, transient memory under 2x the
largest megabatch (the target the benchmark ladder reports)."""

from __future__ import annotations

import pytest
import torch

import orthoptim
from orthoptim.benchmark_counts import count_step, largest_megabatch_bytes
from orthoptim.optim import base

SHAPES = [(128, 128)] * 8 + [(64, 256)] * 4


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    return params


CASES = {
    "muon": lambda p: orthoptim.Muon(p, lr=0.02),
    "normuon": lambda p: orthoptim.NorMuon(p, lr=0.02),
    "dion3": lambda p: orthoptim.Dion3(p, lr=0.02, fraction=0.5),
    "dion2": lambda p: orthoptim.Dion2(p, lr=0.02, fraction=0.5),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parts_give_the_whole_batch_update_and_bounded_transients(name, monkeypatch):
    monkeypatch.setattr(base, "MEMORY_CHUNKS", 1)  # one part: the whole megabatch at once
    whole = _params()
    CASES[name](whole).step()
    reference = _params()
    whole_peak = count_step(CASES[name](reference).step, reference).peak_transient_bytes

    monkeypatch.setattr(base, "MEMORY_CHUNKS", 4)
    monkeypatch.setattr(base, "CHUNK_MIN_ELEMENTS", 1 << 12)
    parts = _params()
    CASES[name](parts).step()
    for a, b in zip(parts, whole):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    params = _params()
    counts = count_step(CASES[name](params).step, params)
    assert counts.peak_transient_bytes < 2 * largest_megabatch_bytes(params), counts.peak_transient_bytes
    if name in ("muon", "normuon"):  # whole-matrix rules: the parts are what bring it under 2x
        assert whole_peak > 2 * largest_megabatch_bytes(params)


@pytest.mark.parametrize(("name", "fraction", "parts"), [("muon", None, 4), ("dion3", 0.5, 2), ("dion3", 0.25, 1),
                                                          ("dion2", 0.125, 1), ("dion2", 0.75, 3)])
def test_row_selecting_rules_split_by_what_they_orthogonalize(name, fraction, parts, monkeypatch):
    """Only what is orthogonalized needs splitting: ceil(4·fraction) parts for Dion2/Dion3 (whole
    batches at f ≤ 1/4, where five temporaries of the selected rows stay under 1.25x the batch)."""
    monkeypatch.setattr(base, "CHUNK_MIN_ELEMENTS", 1 << 10)
    calls: list[int] = []

    def counting(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return orthoptim.newton_schulz(x)

    params = [torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(i))) for i in range(8)]
    for p in params:
        p.grad = torch.randn_like(p)
    cls = {"muon": orthoptim.Muon, "dion3": orthoptim.Dion3, "dion2": orthoptim.Dion2}[name]
    options = {} if fraction is None else {"fraction": fraction}
    cls(params, lr=0.02, orthogonalizer=counting, **options).step()
    assert len(calls) == parts and sum(calls) == len(params), calls
