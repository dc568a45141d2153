"""Polynomial coefficient sets for Newton-Schulz-type polar iterations.

Each set is a sequence of (a, b, c): one iteration maps X to (a I + b A + c A²) X with A = X Xᵀ,
i.e. it applies the odd polynomial p(σ) = aσ + bσ³ + cσ⁵ to every singular value.
"""

from __future__ import annotations

from collections.abc import Sequence

Coefficients = tuple[tuple[float, float, float], ...]

# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932), the five-iteration
# minimax-optimal schedule as published, before any safety scaling.
_POLAR_EXPRESS_RAW: Coefficients = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)

# Safety factor 1.05, as published with Gram Newton-Schulz: each polynomial is evaluated at σ/1.05,
# so singular values inflated by round-off (up to 5%) are still mapped into the convergent range.
POLAR_EXPRESS_SAFETY = 1.05


def scale_coefficients(coefficients: Coefficients, safety: float) -> Coefficients:
    """Return p(σ/safety) for each polynomial: a/s, b/s³, c/s⁵."""
    return tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in coefficients)


POLAR_EXPRESS: Coefficients = scale_coefficients(_POLAR_EXPRESS_RAW, POLAR_EXPRESS_SAFETY)

# Keller Jordan's quintic, used by the original Muon: fast growth of small singular values, and
# deliberately not convergent to exactly 1 (singular values end in roughly [0.7, 1.2]).
KELLER_JORDAN: Coefficients = ((3.4445, -4.7750, 2.0315),) * 5

NAMED_COEFFICIENTS: dict[str, Coefficients] = {
    "polar_express": POLAR_EXPRESS,
    "keller_jordan": KELLER_JORDAN,
}


def as_coefficients(coefficients: str | Sequence[Sequence[float]]) -> Coefficients:
    """Validate a coefficient set given by name or as a sequence of (a, b, c) triples."""
    if isinstance(coefficients, str):
        try:
            return NAMED_COEFFICIENTS[coefficients]
        except KeyError:
            raise ValueError(
                f"coefficients={coefficients!r} is not a known set; use one of "
                f"{sorted(NAMED_COEFFICIENTS)} or a sequence of (a, b, c) triples"
            ) from None
    triples = tuple(tuple(float(v) for v in t) for t in coefficients)
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError("coefficients must be a non-empty sequence of (a, b, c) triples")
    return triples  # type: ignore[return-value]
