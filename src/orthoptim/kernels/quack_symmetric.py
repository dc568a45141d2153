"""The optional external backend: QuACK's CuTeDSL symmetric GEMMs (Hopper sm90, Blackwell sm100).

``pip install 'orthoptim[hopper]'`` installs ``quack-kernels``, whose
``quack.gemm_interface.gemm_symmetric(A, B, C=None, alpha=1, beta=1)`` computes the symmetric
``alpha·A B + beta·C`` from the tiles of one triangle. That is exactly the shape of Gram
Newton-Schulz's products, so this module maps ``gram``, ``symmetric_polynomial`` and
``symmetric_product`` onto it.

Never required, never trusted blindly: the package is imported on the first CUDA call that could
use it, the first use of each product per (device, dtype) is checked against the torch backend,
and any import error, exception or mismatch turns this backend off for the process with one
warning, after which the caller's torch/Triton path runs. The package's interface has changed
between releases, which is why the adapter checks rather than assumes.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from functools import cache

import torch
from torch import Tensor

from orthoptim.caller_warnings import warn_at_caller
from orthoptim.kernels import torch_backend

DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (9, 0)  # Hopper and later
_disabled: str | None = None  # why the backend was turned off, once it was
_verified: set[tuple[str, str, torch.dtype]] = set()  # (product, device, dtype) checked against torch


@cache
def installed() -> bool:
    """Whether ``quack`` can be imported (checked without importing it)."""
    return importlib.util.find_spec("quack") is not None


def _kernel() -> Callable[..., Tensor]:
    return importlib.import_module("quack.gemm_interface").gemm_symmetric


def can_run(*tensors: Tensor) -> bool:
    """CUDA tensors of fp16/bf16 on sm90+, last dim contiguous, package installed and not turned off."""
    if _disabled is not None or not installed():
        return False
    if not all(t.is_cuda and t.dtype in DTYPES and t.stride(-1) == 1 for t in tensors):
        return False
    return torch.cuda.get_device_capability(tensors[0].device) >= MIN_CAPABILITY


def _disable(reason: str) -> None:
    global _disabled
    _disabled = reason
    warn_at_caller(f"orthoptim: the external QuACK symmetric GEMM backend is off for this process ({reason}); "
                   "using the built-in kernels instead", RuntimeWarning)


def _symmetric(a: Tensor, b: Tensor, c: Tensor | None, alpha: float, beta: float) -> Tensor:
    out = _kernel()(a, b, C=c, alpha=alpha, beta=beta) if c is not None else _kernel()(a, b, alpha=alpha)
    return out[1] if isinstance(out, tuple) else out  # some releases return (pre-activation, out)


# Relative Frobenius error allowed on the first-use check: half precision gives ~1e-3.
CHECK_TOLERANCE = 1e-2


def _checked(name: str, fast: Callable[[], Tensor], reference: Callable[[], Tensor], like: Tensor) -> Tensor | None:
    """``fast()``, or None (backend turned off) when it raises or, on its first use for this product,
    device and dtype, is further than ``CHECK_TOLERANCE`` from the torch backend."""
    key = (name, str(like.device), like.dtype)
    capturing = like.is_cuda and torch.cuda.is_current_stream_capturing()
    try:
        out = fast()
        if key not in _verified:
            if capturing:  # the check reads a value on the host: it must have run in an eager warm-up step
                raise RuntimeError(f"QuACK {name} was first used inside a CUDA-graph capture; run warm-up steps")
            want = reference().float()
            error = torch.linalg.vector_norm(out.float() - want) / torch.linalg.vector_norm(want).clamp_min(1e-30)
            if out.shape != want.shape or not bool(error < CHECK_TOLERANCE):
                _disable(f"{name} disagreed with torch on its first use")
                return None
            _verified.add(key)
        return out
    except Exception as e:  # any failure of an optional package must not stop training
        if capturing:
            raise  # a failed capture cannot be repaired by a fallback inside it
        _disable(f"{name} raised {type(e).__name__}: {e}")
        return None


def gram(x: Tensor) -> Tensor | None:
    """X Xᵀ [B, k, k], or None if the backend cannot run it."""
    return _checked("gram", lambda: _symmetric(x, x.mT, None, 1.0, 0.0), lambda: torch_backend.gram(x), x)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float) -> Tensor | None:
    """a I + b R + c R² for symmetric R, or None: one symmetric GEMM with R as its C operand."""
    def fast() -> Tensor:
        p = _symmetric(r, r, r, c, b)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        return p
    return _checked("symmetric_polynomial", fast, lambda: torch_backend.symmetric_polynomial(r, a, b, c), r)


def symmetric_product(p: Tensor, q: Tensor) -> Tensor | None:
    """P Q for symmetric, commuting P, Q (a symmetric result), or None."""
    return _checked("symmetric_product", lambda: _symmetric(p, q, None, 1.0, 0.0),
                    lambda: torch_backend.symmetric_product(p, q), p)
