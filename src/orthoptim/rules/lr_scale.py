"""Learning-rate shape scale s(m, n) for an orthonormal update of an m×n matrix."""

from __future__ import annotations

import math

ADJUST_LR_MODES = ("spectral_norm", "rms_norm", "original", None)
# torch.optim.Muon's adjust_lr_fn values, as orthoptim spells them (for error messages).
TORCH_ADJUST_LR = {"match_rms_adamw": "rms_norm"}


def lr_scale(rows: int, cols: int, adjust_lr: str | None) -> float:
    """``"spectral_norm"``: √(m/n) (an orthonormal update with spectral norm scaled to the layer's
    fan-out/fan-in); ``"rms_norm"``: 0.2·√max(m, n) (matches AdamW's update RMS, so AdamW learning
    rates carry over); ``"original"``: √max(1, m/n) (Keller Jordan's Muon and torch.optim.Muon's
    default: wide matrices keep the plain lr); ``None``: 1."""
    if adjust_lr == "spectral_norm":
        return math.sqrt(rows / cols)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(rows, cols))
    if adjust_lr == "original":
        return math.sqrt(max(1.0, rows / cols))
    if adjust_lr is None:
        return 1.0
    raise ValueError(f"adjust_lr={adjust_lr!r} is not supported; use 'spectral_norm', 'rms_norm', 'original' or None")
