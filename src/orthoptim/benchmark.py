"""Shared pieces for measuring optimizer speed: GPT-shaped parameter sets, timing, accuracy.

Used by ``benchmarks/ladder.py``, ``benchmarks/gram_vs_ns.py`` and ``orthoptim bench``; the FLOP,
byte and memory counters are in ``orthoptim.benchmark_counts``. Timing reports every repeat so
callers quote medians, never single runs.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import Tensor

import orthoptim
from orthoptim.orthogonalize import POLAR_EXPRESS, newton_schulz, newton_schulz_factors, svd_polar

# d_model, layers: shapes of the matrices of GPT-style models of roughly these sizes (embeddings,
# norms and the head are not matrices an orthonormal rule sees, so they are left out). MLP 4·d_model:
# 124m 85 M matrix parameters (GPT-2 small), 1b 805 M (+ a 50k-token embedding ≈ 0.9 B),
# 7b 6.4 B (Llama-7B's width and depth with a 4·d MLP instead of its 11008 SwiGLU).
PRESETS: dict[str, tuple[int, int]] = {
    "d512": (512, 4),
    "d1024": (1024, 4),
    "124m": (768, 12),
    "350m": (1024, 24),
    "1b": (2048, 16),
    "7b": (4096, 32),
}


def gpt_matrix_shapes(d_model: int, n_layers: int, mlp_ratio: int = 4) -> list[tuple[int, int]]:
    """Per layer: q, k, v, o ([d, d]), MLP up ([r·d, d]) and down ([d, r·d]), in torch Linear layout."""
    hidden = mlp_ratio * d_model
    layer = [(d_model, d_model)] * 4 + [(hidden, d_model), (d_model, hidden)]
    return layer * n_layers


def parse_set(spec: str) -> tuple[str, int, int, int]:
    """A matrix set by name: (label, d_model, layers, the preset's layers).

    ``"1b"`` is the preset; ``"1b:2"`` its widths with 2 layers only; ``"d64x3"`` any width and depth.
    """
    custom = re.fullmatch(r"d(\d+)x(\d+)", spec)
    if custom:
        d_model, layers = int(custom[1]), int(custom[2])
        if d_model < 1 or layers < 1:
            raise ValueError(f"set {spec!r}: width and layers must be positive")
        return spec, d_model, layers, layers
    name, colon, layers = spec.partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown set {spec!r}; use one of {', '.join(PRESETS)}, optionally with :LAYERS "
                         "(e.g. 1b:2), or dWIDTHxLAYERS (e.g. d64x2)")
    d_model, preset_layers = PRESETS[name]
    if not colon:
        return name, d_model, preset_layers, preset_layers
    if not layers.isdigit() or int(layers) < 1:
        raise ValueError(f"set {spec!r}: the layer count after ':' must be a positive integer")
    n = int(layers)
    return (name if n == preset_layers else f"{name}:{n}"), d_model, n, preset_layers


def make_params(
    shapes: Sequence[tuple[int, ...]], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
    seed: int = 0, on_device: bool = False,
) -> list[Tensor]:
    """Parameters with fixed random gradients attached (timing does not need fresh gradients).

    ``on_device``: draw the numbers on ``device`` (a CUDA generator): billions of parameters take
    minutes to draw on a CPU. The values then differ from the CPU-drawn ones of the same seed.
    """
    gen = torch.Generator(device=device if on_device else "cpu").manual_seed(seed)
    where = device if on_device else "cpu"
    params = []
    for shape in shapes:
        p = (torch.randn(shape, generator=gen, device=where) * 0.02).to(device=device, dtype=dtype)
        p.requires_grad_(True)
        p.grad = torch.randn(shape, generator=gen, device=where).to(device=device, dtype=dtype)
        params.append(p)
    return params


def _orthoptim(cls: type, **kwargs: Any) -> Callable[[list[Tensor]], torch.optim.Optimizer]:
    return lambda params: cls(params, **kwargs)


def optimizer_factories() -> dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]]:
    """Name → constructor over a list of matrix parameters, for every optimizer worth comparing."""
    factories: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
        "muon": _orthoptim(orthoptim.Muon, lr=0.01),
        "muon_gram": _orthoptim(orthoptim.Muon, lr=0.01, orthogonalizer="gram"),
        "normuon": _orthoptim(orthoptim.NorMuon, lr=0.01),
        "dion3": _orthoptim(orthoptim.Dion3, lr=0.01, fraction=0.25),
        "dion3_f0.5": _orthoptim(orthoptim.Dion3, lr=0.01, fraction=0.5),
        "dion3_f0.125": _orthoptim(orthoptim.Dion3, lr=0.01, fraction=0.125),
        "dion2": _orthoptim(orthoptim.Dion2, lr=0.01, fraction=0.25),
        "dion_r0.25": _orthoptim(orthoptim.Dion, lr=0.01, rank_fraction=0.25),
    }
    if hasattr(torch.optim, "Muon"):
        factories["torch_muon"] = lambda params: torch.optim.Muon(params, lr=0.01)
    return factories


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], Any], warmup: int = 2, repeats: int = 5,
               device: str | torch.device = "cpu") -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``step`` after ``warmup`` untimed calls."""
    device = torch.device(device)
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def orthogonalization_error(orthogonalize: Callable[[Tensor], Tensor], shape: tuple[int, int],
                            batch: int = 2, device: str = "cpu", seed: int = 0) -> float:
    """Relative Frobenius distance of ``orthogonalize`` to the exact polar factor on random matrices
    shaped like a momentum (Gaussian, so singular values spread down towards 0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((batch, *shape), generator=gen).to(device)
    exact = svd_polar(x.double())
    approx = orthogonalize(x).double()
    return float(torch.linalg.vector_norm(approx - exact) / torch.linalg.vector_norm(exact))


# The ladder's "muon+sym" and "muon_bmm" rungs: standard Newton-Schulz with its symmetric products
# on the kernels everywhere, and with every product a plain bmm (each with its factored form, so
# that Muon fuses the last product into the update as for "muon"). "muon" itself takes the default:
# the kernels on CPUs, plain products on accelerators.
symmetric_newton_schulz = partial(newton_schulz, coefficients=POLAR_EXPRESS, symmetric_kernels=True)
symmetric_newton_schulz.factored = partial(newton_schulz_factors, coefficients=POLAR_EXPRESS,  # type: ignore[attr-defined]
                                           symmetric_kernels=True)
plain_newton_schulz = partial(newton_schulz, coefficients=POLAR_EXPRESS, symmetric_kernels=False)
plain_newton_schulz.factored = partial(newton_schulz_factors, coefficients=POLAR_EXPRESS,  # type: ignore[attr-defined]
                                       symmetric_kernels=False)


def orthogonalizer_callables() -> dict[str, Callable[[Tensor], Tensor]]:
    """The library's named orthogonalizers, for accuracy tables."""
    return {
        "polar_express": partial(orthoptim.newton_schulz, coefficients="polar_express"),
        "gram": partial(orthoptim.gram_newton_schulz, coefficients="polar_express"),
        "newton_schulz": partial(orthoptim.newton_schulz, coefficients="keller_jordan"),
    }


def smallest_winning_size(wins: Mapping[int, bool]) -> int | None:
    """The smallest size k such that a kernel won at k and at every larger size measured (``wins``:
    size → whether it won everything measured there); None when it lost at the largest size."""
    best = None
    for k in sorted(wins, reverse=True):
        if not wins[k]:
            break
        best = k
    return best


@contextmanager
def environment_variable(name: str, value: str | None) -> Iterator[None]:
    """Set the environment variable ``name`` to ``value`` for a block (nothing when ``value`` is None)."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
