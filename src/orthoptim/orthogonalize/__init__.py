"""Pure math on batched matrices [B, k, n]: polar iterations, coefficients, power iteration."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from orthoptim.orthogonalize._common import WIDE_RANGE, PolarFactors, working_dtype
from orthoptim.orthogonalize.coefficients import (
    KELLER_JORDAN,
    POLAR_EXPRESS,
    POLAR_EXPRESS_SAFETY,
    Coefficients,
    as_coefficients,
    scale_coefficients,
)
from orthoptim.orthogonalize.gram_newton_schulz import (
    DEFAULT_RESTARTS,
    gram_newton_schulz,
    gram_newton_schulz_factors,
)
from orthoptim.orthogonalize.newton_schulz import newton_schulz, newton_schulz_factors
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
# The named iterations without their last product (see PolarFactors): a rule that adds the polar
# factor to the parameters lets that product write into them directly.
FACTORED_ORTHOGONALIZERS: dict[str, Callable[[Tensor], PolarFactors]] = {
    "gram": partial(gram_newton_schulz_factors, coefficients=POLAR_EXPRESS),
    "polar_express": partial(newton_schulz_factors, coefficients=POLAR_EXPRESS),
    "newton_schulz": partial(newton_schulz_factors, coefficients=KELLER_JORDAN),
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


def input_dtype(spec: str | Orthogonalizer, x: Tensor, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype the named iteration ``spec`` would first round a batch like ``x`` to, when it can take
    the batch in that dtype directly (a bf16 or fp32 iteration; see ``_common.start``); else None.

    A caller that builds the batch (Muon stacks its momenta) can then write it in that dtype: the
    iteration does the same work on it, without a full-precision copy to read and round.
    ``dtype`` is the iteration's explicit ``dtype=``, if one was given to it.
    """
    if not isinstance(spec, str) or spec not in FACTORED_ORTHOGONALIZERS:
        return None
    accelerator_default = torch.float16 if spec == "gram" else torch.bfloat16
    work = working_dtype(x, dtype, accelerator_default)
    if work not in WIDE_RANGE or (x.dtype == torch.float64 and work != torch.float64):
        return None  # fp16's X Xᵀ could overflow; float64 is normalized in float64 first (``start``)
    return work


def get_factored_orthogonalizer(spec: str | Orthogonalizer) -> Callable[[Tensor], PolarFactors] | None:
    """The factored form of an orthogonalizer, or None: a named iteration's, or a callable's
    ``factored`` attribute (a function [B, k, n] → PolarFactors computing the same thing); "svd" and
    other callables only give products."""
    if isinstance(spec, str):
        return FACTORED_ORTHOGONALIZERS.get(spec)
    return getattr(spec, "factored", None)


__all__ = [
    "DEFAULT_RESTARTS",
    "FACTORED_ORTHOGONALIZERS",
    "KELLER_JORDAN",
    "ORTHOGONALIZERS",
    "POLAR_EXPRESS",
    "POLAR_EXPRESS_SAFETY",
    "Coefficients",
    "Orthogonalizer",
    "PolarFactors",
    "as_coefficients",
    "get_factored_orthogonalizer",
    "get_orthogonalizer",
    "gram_newton_schulz",
    "gram_newton_schulz_factors",
    "input_dtype",
    "newton_schulz",
    "newton_schulz_factors",
    "normalize_columns",
    "orthonormalize_columns",
    "power_iteration",
    "scale_coefficients",
    "svd_polar",
]
