"""The dtype the polar iterations run in on a CPU: bf16 where the CPU multiplies bf16 natively, else fp32.

CPUs with AMX tiles (Intel Sapphire Rapids and later) or AVX-512 BF16 run oneDNN's bf16 GEMMs
~4x faster than fp32 ones at the 512-wide products of GPT matrices (measured on one Sapphire Rapids
core: ~450 against ~115 GFLOP/s; ~7x on a 2048³ product, 983 against 144);
without them bf16 is emulated and ~50x slower than fp32. Newton-Schulz in bf16 is what Muon runs
on GPUs, and on matrices of full numerical rank its error against the exact polar factor stays that
of the coefficient schedule (``tests/test_cpu_dtype.py``), so the fast dtype is the default where it
exists. As on GPUs, a momentum of low numerical rank differs: rounding it to bf16 adds singular
values of ~2⁻⁹ of its largest, which the iteration lifts toward 1 like real ones (for a rank-1
gradient the update's cosine with u vᵀ is ~0.6 in bf16, 1.0 in fp32); ``ORTHOPTIM_CPU_DTYPE=float32``
keeps such updates exact, at ~4x the time.

``ORTHOPTIM_CPU_DTYPE`` (read at every call, so tests and benchmarks can switch it):
``auto`` (default, also when unset or empty), ``float32`` or ``bfloat16``. An explicit ``dtype=``
given to an orthogonalizer wins over all of these; float64 inputs always stay float64.
"""

from __future__ import annotations

import os
from functools import cache

import torch

ENV_VAR = "ORTHOPTIM_CPU_DTYPE"
CHOICES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def _cpu_reports(*probes: str) -> bool:
    """Whether oneDNN is built in and torch says this CPU has any of ``probes`` (private ``torch.cpu``
    checks, so looked up defensively)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


@cache
def native_bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AMX-BF16 or AVX-512 BF16) that oneDNN uses."""
    return _cpu_reports("_is_amx_tile_supported", "_is_avx512_bf16_supported")


@cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids and later), whose bf16 GEMMs keep their
    rate only as large single products (``select`` blocks bf16 products there from larger sizes)."""
    return _cpu_reports("_is_amx_tile_supported")


def requested() -> str:
    """The value of ``ORTHOPTIM_CPU_DTYPE`` (``auto`` when unset), validated."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not supported; use one of {list(CHOICES)}")
    return value


def iteration_dtype() -> torch.dtype:
    """The dtype of a polar iteration on fp32 or half-precision CPU inputs when none is given."""
    chosen = CHOICES[requested()]
    if chosen is not None:
        return chosen
    # With oneDNN switched off (torch.backends.mkldnn.enabled = False) bf16 matmuls take the slow path.
    fast = native_bf16_matmul() and torch.backends.mkldnn.enabled
    return torch.bfloat16 if fast else torch.float32


def iteration_dtype_name() -> str:
    """``iteration_dtype()`` as ``ORTHOPTIM_CPU_DTYPE`` spells it, e.g. ``"bfloat16"``."""
    return str(iteration_dtype()).removeprefix("torch.")


def describe() -> str:
    """What was asked and what runs, e.g. ``"auto -> bfloat16"``: for the records of runs and benchmarks."""
    return f"{requested()} -> {iteration_dtype_name()}"
