"""Up-front checks of every hyperparameter, with errors that name the value and the fix."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from orthoptim.orthogonalize import get_orthogonalizer
from orthoptim.rules.lr_scale import ADJUST_LR_MODES, TORCH_ADJUST_LR

MATRIX_ALGORITHMS = ("dion3", "dion2", "dion", "muon", "normuon")
SCALAR_ALGORITHMS = ("adamw", "lion")
ALGORITHMS = MATRIX_ALGORITHMS + SCALAR_ALGORITHMS
NONFINITE_MODES = ("raise", "skip")
SELECTION_SCOPES = ("local", "global")
QR_METHODS = ("cholesky_qr", "qr")


# The options each algorithm reads, beyond algorithm, lr, weight_decay and nonfinite (all read them).
_MATRIX_VIEW = frozenset({"adjust_lr", "flatten", "transpose", "num_heads", "split_sizes"})
READS: dict[str, frozenset[str]] = {
    "muon": _MATRIX_VIEW | {"mu", "nesterov", "orthogonalizer"},
    "normuon": _MATRIX_VIEW | {"mu", "nesterov", "orthogonalizer", "muon_beta2", "epsilon"},
    "dion2": _MATRIX_VIEW | {"fraction", "mu", "orthogonalizer", "selection_scope"},
    "dion3": _MATRIX_VIEW | {"fraction", "mu", "orthogonalizer", "selection_scope", "muon_beta2", "epsilon"},
    "dion": _MATRIX_VIEW | {"rank_fraction", "mu", "epsilon", "qr_method"},
    "adamw": frozenset({"betas", "epsilon"}),
    "lion": frozenset({"betas"}),
}
_READ_BY_ALL = frozenset({"algorithm", "lr", "weight_decay", "nonfinite"})


def options_read_by(algorithm: str) -> frozenset[str]:
    """Every group option ``algorithm`` reads (none but the common ones for an unknown name)."""
    return READS.get(algorithm, frozenset()) | _READ_BY_ALL


def unread_options(given: Mapping[str, Any], algorithm: str, known: set[str] | frozenset[str]) -> list[str]:
    """The options among ``known`` that a group sets itself (``given``, without the optimizer's
    defaults) but its ``algorithm`` never reads, e.g. ``fraction`` on a Muon group: most likely meant
    for another algorithm, and otherwise silently without effect."""
    reads = options_read_by(algorithm)
    return sorted(k for k in given if k in known and k not in reads)


def readers_of(key: str) -> list[str]:
    """The algorithms that read the option ``key``."""
    return [a for a in ALGORITHMS if key in options_read_by(a)]


def plain_numbers(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with numpy scalars (np.float64(0.02) from a config or a sweep, also inside tuples
    such as betas) as Python numbers: a state dict holding them does not load with
    ``torch.load(weights_only=True)``."""
    def plain(value: Any) -> Any:
        if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
            return value.item()
        return tuple(plain(v) for v in value) if isinstance(value, tuple) else value
    return {key: value if key in ("params", "param_names") else plain(value) for key, value in options.items()}


def _number(group: Mapping[str, Any], key: str, where: str) -> float:
    value = group[key]
    if key == "lr" and isinstance(value, torch.Tensor) and value.ndim == 0 and value.is_floating_point():
        try:  # a tensor learning rate (capturable steps, schedulers that fill it in place)
            value = float(value)
        except (RuntimeError, NotImplementedError):
            raise ValueError(f"lr in {where} is a tensor on {value.device}, which holds no value to check; "
                             "put it on the parameters' device") from None
    # numbers.Real admits NumPy scalars (np.float32 is no Python float); bools are refused.
    if key == "lr" and isinstance(value, torch.Tensor):
        raise ValueError(f"lr={value!r} in {where} must be a finite number or a 0-dim floating-point tensor "
                         f"(torch.tensor(0.02)), not a tensor of shape {tuple(value.shape)} and dtype {value.dtype}")
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} in {where} must be a finite number")
    return float(value)


def _in_range(group, key, where, low, high, *, low_open=False, high_open=False, hint=""):
    v = _number(group, key, where)
    bad = (v <= low if low_open else v < low) or (v >= high if high_open else v > high)
    if bad:
        if high == math.inf:  # an interval up to inf would read as if inf were allowed
            raise ValueError(f"{key}={v} in {where} must be {'>' if low_open else '>='} {low}{hint}")
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{key}={v} in {where} must be in {interval}{hint}")


def validate_group(group: Mapping[str, Any], where: str) -> None:
    """Check the hyperparameters of one param group (defaults merged in). Raises ValueError."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r} in {where} is unknown; use one of {list(ALGORITHMS)}")
    _in_range(group, "lr", where, 0.0, math.inf, hint="; learning rates are non-negative")
    _in_range(group, "weight_decay", where, 0.0, math.inf, hint="; use 0 to disable weight decay")
    _in_range(group, "epsilon", where, 0.0, math.inf, low_open=True, hint="; a small positive guard like 1e-8")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas={betas!r} in {where} must be a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        _in_range({f"betas[{i}]": b}, f"betas[{i}]", where, 0.0, 1.0, high_open=True)
    if group["nonfinite"] not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={group['nonfinite']!r} in {where} must be 'raise' or 'skip'")
    if algorithm in SCALAR_ALGORITHMS:
        return
    _in_range(group, "mu", where, 0.0, 1.0, high_open=True, hint="; the usual value is 0.95")
    _in_range(group, "fraction", where, 0.0, 1.0, low_open=True, hint="; e.g. 0.25 updates a quarter of the rows")
    _in_range(group, "rank_fraction", where, 0.0, 1.0, low_open=True, hint="; e.g. 0.25, 1/16 or 1/64")
    _in_range(group, "muon_beta2", where, 0.0, 1.0, high_open=True)
    if group["adjust_lr"] not in ADJUST_LR_MODES:
        raise ValueError(
            f"adjust_lr={group['adjust_lr']!r} in {where} is unknown; use 'spectral_norm', 'rms_norm', 'original' "
            "or None" + (f" (torch.optim.Muon's adjust_lr_fn={group['adjust_lr']!r} is "
                         f"adjust_lr={TORCH_ADJUST_LR[group['adjust_lr']]!r} here)"
                         if group["adjust_lr"] in TORCH_ADJUST_LR else "")
        )
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov={group['nesterov']!r} in {where} must be True or False")
    for key in ("flatten", "transpose"):
        if not isinstance(group[key], bool):
            raise ValueError(f"{key}={group[key]!r} in {where} must be True or False")
    if group["selection_scope"] not in SELECTION_SCOPES:
        raise ValueError(f"selection_scope={group['selection_scope']!r} in {where} must be 'local' or 'global'")
    if group["qr_method"] not in QR_METHODS:
        raise ValueError(f"qr_method={group['qr_method']!r} in {where} must be 'cholesky_qr' or 'qr'")
    if group["orthogonalizer"] is not None:
        get_orthogonalizer(group["orthogonalizer"], name=f"orthogonalizer in {where}")
    heads = group["num_heads"]
    if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0):
        raise ValueError(f"num_heads={heads!r} in {where} must be a positive int or None")
    splits = group["split_sizes"]
    # A list or tuple only: a generator would be used up by this check before the step reads it.
    if splits is not None and (
        not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in splits)
    ):
        raise ValueError(f"split_sizes={splits!r} in {where} must be a list or tuple of ints (the row counts of "
                         "the fused blocks, e.g. [d, d, d] for a fused QKV) or None")
