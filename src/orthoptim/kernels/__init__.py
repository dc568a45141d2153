"""Backends for the matrix products the orthogonalizers are made of, and Dion3's fused update.

Every function here has a torch implementation (``torch_backend``, correct on every device) and a
Triton one (``triton_symmetric``, ``triton_dion3``) used on CUDA when ``triton`` is installed and the
problem is big enough to win; the symmetric products can also run on QuACK's external CuTeDSL
kernels (``quack_symmetric``, the ``hopper`` extra), which fall back here on any failure, and, on
CPUs, block by block with only the upper half computed (``cpu_symmetric``) where k is large enough.
``ORTHOPTIM_KERNELS=torch|triton|quack|blocked|auto`` overrides the choice (see ``select``). Triton and
QuACK are optional: nothing here imports them until a CUDA tensor asks for them, and under ``auto``
a failing Triton kernel hands this and every later call to the torch backend (one warning).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from orthoptim.kernels import cpu_symmetric, quack_symmetric, select, torch_backend
from orthoptim.kernels.select import ENV_VAR, MIN_BLOCKED_SIZE, MIN_TRITON_SIZE

_SYMMETRIC = "triton_symmetric"
_DION3 = "triton_dion3"
_FAILED = object()


def _run_triton(module: str, function: str, *args: object, **kwargs: object) -> object:
    """``module.function(*args, **kwargs)``, or ``_FAILED`` when it raised under ``auto`` (the module is
    then turned off; see ``select.turn_off_triton``). Every Triton function here writes only fresh
    tensors until its last launch, so the torch backend can redo the call from the same inputs.
    ``ORTHOPTIM_KERNELS=triton`` raises the error instead, and out-of-memory errors are always raised."""
    try:
        return getattr(select.triton_module(module), function)(*args, **kwargs)
    except torch.cuda.OutOfMemoryError:
        raise  # torch would run out as well; not a reason to give up on Triton for the whole process
    except Exception as error:
        if select.requested() == "triton":
            raise
        select.turn_off_triton(module, error)
        return _FAILED


def backend(x: Tensor, size: int | None = None, inner: int | None = None) -> str:
    """The backend ("torch", "triton", "quack" or "blocked") a symmetric product with output side
    ``size`` would use (``inner``: the inner side, n for X Xᵀ of a [k, n] X; None for the k×k products)."""
    if select.use_quack(x, size=size):
        return "quack"
    if select.use_triton(x, size=size, module=_SYMMETRIC):
        return "triton"
    return "blocked" if select.use_blocked(x, size=size, inner=inner) else "torch"


def gram(x: Tensor, out: Tensor | None = None) -> Tensor:
    """X Xᵀ for a batch [B, k, n] → [B, k, k] (symmetric).

    ``out`` (here and below): where the torch and blocked backends write the result (a contiguous
    [B, k, k] tensor of the inputs' dtype; the blocked one takes a fresh tensor for any other). The
    Triton and QuACK kernels return fresh tensors, so callers use the returned tensor, not ``out``.
    """
    if select.use_quack(x, size=x.shape[-2]) and (out := quack_symmetric.gram(x)) is not None:
        return out
    if select.use_triton(x, size=x.shape[-2], module=_SYMMETRIC) and \
            (result := _run_triton(_SYMMETRIC, "gram", x)) is not _FAILED:
        return result
    k, n = x.shape[-2:]
    if select.use_blocked(x, size=k, inner=n):
        return cpu_symmetric.gram(x, out=out, block=select.blocked_gram_rows(k, n))
    return torch_backend.gram(x, out=out)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float, out: Tensor | None = None) -> Tensor:
    """a I + b R + c R² for a batch of symmetric R [B, k, k] (``out``, if given, must not be ``r``)."""
    if select.use_quack(r, size=r.shape[-1]) and (out := quack_symmetric.symmetric_polynomial(r, a, b, c)) is not None:
        return out
    if select.use_triton(r, size=r.shape[-1], module=_SYMMETRIC) and \
            (result := _run_triton(_SYMMETRIC, "symmetric_polynomial", r, a, b, c)) is not _FAILED:
        return result
    if select.use_blocked(r, size=r.shape[-1]):
        return cpu_symmetric.symmetric_polynomial(r, a, b, c, out=out)
    return torch_backend.symmetric_polynomial(r, a, b, c, out=out)


def symmetric_product(p: Tensor, q: Tensor, out: Tensor | None = None) -> Tensor:
    """P Q for batches of symmetric P, Q [B, k, k] that commute (e.g. polynomials in one matrix R).

    The result is then symmetric, which the Triton and blocked kernels rely on: they compute one
    half only.
    """
    if p.dtype == q.dtype and select.use_quack(p, q, size=p.shape[-1]) and \
            (out := quack_symmetric.symmetric_product(p, q)) is not None:
        return out
    if p.dtype == q.dtype and select.use_triton(p, q, size=p.shape[-1], module=_SYMMETRIC) and \
            (result := _run_triton(_SYMMETRIC, "symmetric_product", p, q)) is not _FAILED:
        return result
    if p.dtype == q.dtype and select.use_blocked(p, q, size=p.shape[-1]):
        return cpu_symmetric.symmetric_product(p, q, out=out)
    return torch_backend.symmetric_product(p, q, out=out)


def dion3_post_update(
    params: Tensor | Sequence[Tensor],
    index: Tensor | Sequence[Tensor],
    o: Tensor,
    v: Tensor | None,
    *,
    lr: float | Tensor,
    weight_decay: float,
    scale: float,
    beta2: float,
    eps: float,
    normalize: bool = True,
) -> Tensor | None:
    """Dion3 after orthogonalization: NorMuon normalization of the selected rows, weight decay on
    every row, scaled update into the selected rows, with one rounding to the parameter dtype.

    See ``torch_backend.dion3_post_update`` for the contract; the Triton kernel (CUDA) computes the
    same in fewer passes over X.
    """
    options = {"lr": lr, "weight_decay": weight_decay, "scale": scale, "beta2": beta2, "eps": eps,
               "normalize": normalize}
    # The Triton kernel takes lr as a number; a tensor lr (capturable) uses the torch backend.
    if not isinstance(lr, Tensor) and _dion3_triton(params, index, o, v, normalize) and \
            (result := _run_triton(_DION3, "dion3_post_update", params, index, o, v, **options)) is not _FAILED:
        return result  # type: ignore[return-value]
    return torch_backend.dion3_post_update(params, index, o, v, **options)


def _dion3_triton(
    params: Tensor | Sequence[Tensor], index: Tensor | Sequence[Tensor], o: Tensor, v: Tensor | None, normalize: bool
) -> bool:
    if len(params) == 0 or o.numel() == 0 or params[0].numel() == 0:
        return False
    if not isinstance(index, Tensor):
        if any(i.device != o.device for i in index):
            return False
        index = o  # only its device is read below
    tensors = (params[0], o) if isinstance(params, Tensor) or len(params) == 1 else (params[0], params[-1], o)
    if not select.use_triton(*tensors, module=_DION3):
        return False
    if index.device != o.device or (normalize and (v is None or v.dtype != torch.float32 or v.device != o.device)):
        return False
    return _run_triton(_DION3, "supported", params) is True  # importing the module may fail too


__all__ = [
    "ENV_VAR",
    "MIN_BLOCKED_SIZE",
    "MIN_TRITON_SIZE",
    "backend",
    "dion3_post_update",
    "gram",
    "symmetric_polynomial",
    "symmetric_product",
]
