"""Pure math on batched matrices [B, k, n]: polar iterations, coefficients, power iteration."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import Tensor

from orthoptim.orthogonalize.coefficients import (
    KELLER_JORDAN,
    POLAR_EXPRESS,
    POLAR_EXPRESS_SAFETY,
    Coefficients,
    as_coefficients,
    scale_coefficients,
)
from orthoptim.orthogonalize.gram_newton_schulz import DEFAULT_RESTARTS, gram_newton_schulz
from orthoptim.orthogonalize.newton_schulz import newton_schulz
from orthoptim.orthogonalize.polar import svd_polar
from orthoptim.orthogonalize.power_iteration import (
    normalize_columns,
    orthonormalize_columns,
    power_iteration,
)

Orthogonalizer = Callable[[Tensor], Tensor]

ORTHOGONALIZERS: dict[str, Orthogonalizer] = {
    "gram": partial(gram_newton_schulz, coefficients=POLAR_EXPRESS),
    "polar_express": partial(newton_schulz, coefficients=POLAR_EXPRESS),
    "newton_schulz": partial(newton_schulz, coefficients=KELLER_JORDAN),
    "svd": svd_polar,
}


def get_orthogonalizer(spec: str | Orthogonalizer, name: str = "orthogonalizer") -> Orthogonalizer:
    """Resolve a name from ORTHOGONALIZERS, or accept any callable mapping [B, k, n] → [B, k, n]."""
    if callable(spec):
        return spec
    if isinstance(spec, str) and spec in ORTHOGONALIZERS:
        return ORTHOGONALIZERS[spec]
    raise ValueError(
        f"{name}={spec!r} is not supported; use one of {sorted(ORTHOGONALIZERS)} "
        "or a callable mapping a batch [B, k, n] to its orthogonalized batch"
    )


__all__ = [
    "DEFAULT_RESTARTS",
    "KELLER_JORDAN",
    "ORTHOGONALIZERS",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_SAFETY",
    "Coefficients",
    "Orthogonalizer",
    "as_coefficients",
    "get_orthogonalizer",
    "gram_newton_schulz",
    "newton_schulz",
    "normalize_columns",
    "orthonormalize_columns",
    "power_iteration",
    "scale_coefficients",
    "svd_polar",
]
