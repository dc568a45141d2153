"""Triton kernels for Dion3's update after orthogonalization, with one rounding to the parameter dtype.

For each matrix X [m, n] of a megabatch, its selected rows S (k of them), their orthogonalized rows
O [k, n] and their variance V [k] (fp32):

    s_r   = Σ_j O[r, j]²                                   (fp32)
    V'_r  = β₂ V_r + (1 − β₂) s_r / n                      (NorMuon's per-row second moment)
    ratio = ‖O‖_F / ‖Ô‖_F,  ‖O‖² = Σ_r s_r,  ‖Ô‖² = Σ_r s_r / (√V'_r + ε)²
    X[i]  ← X[i] · (1 − lr·wd)                                         for rows i ∉ S
    X[S_r] ← X[S_r] · (1 − lr·wd) − lr·scale·ratio · O[r] / (√V'_r + ε) for the selected rows

Three launches: (1) per-row sums of squares s and, for each parameter row, the position of the row
in S (−1 when not selected); (2) one program per matrix turns s and V into V' and a per-row
coefficient (the Frobenius rescale is a reduction over the whole matrix, hence a separate pass);
(3) one pass over X that reads each element once, computes its new value in fp32 and stores it
once in X's dtype. Without weight decay pass (3) visits the selected rows only.

Importing this module needs ``triton``; see ``triton_common`` for the CPU interpreter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from orthoptim.kernels.triton_common import INTERPRET, device_of, emulate_bf16_rounding, to_output

BLOCK_ROWS = 16 if INTERPRET else 32
BLOCK_COLS = 32 if INTERPRET else 128
STATS_BLOCK = 32 if INTERPRET else 1024


@triton.jit
def _row_sumsq_kernel(
    o_ptr, index_ptr, position_ptr, sumsq_ptr,
    k, n,
    stride_ob, stride_ok, stride_on,
    stride_ib, stride_pb,
    COMPUTE_SUMSQ: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < k
    # position[b, S[b, r]] = r: which selected row (if any) each parameter row is.
    rows = tl.load(index_ptr + batch * stride_ib + r, mask=r_ok, other=-1)
    tl.store(position_ptr + batch * stride_pb + rows, r.to(tl.int32), mask=rows >= 0)  # −1 pads a ragged selection
    if COMPUTE_SUMSQ:
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        cols = tl.arange(0, BLOCK_N)
        o_ptrs = o_ptr + batch * stride_ob + r[:, None] * stride_ok + cols[None, :] * stride_on
        for n0 in range(0, n, BLOCK_N):
            ok = r_ok[:, None] & ((n0 + cols) < n)[None, :]
            o = tl.load(o_ptrs, mask=ok, other=0.0).to(tl.float32)
            acc += tl.sum(o * o, axis=1)
            o_ptrs += BLOCK_N * stride_on
        tl.store(sumsq_ptr + batch * k + r, acc, mask=r_ok)


@triton.jit
def _row_coefficient_kernel(
    sumsq_ptr, v_ptr, v_new_ptr, coef_ptr,
    k, n, step, beta2, eps, tiny,  # n as a float: an int 1 would arrive as a constant
    BLOCK: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(0).to(tl.int64)
    base = batch * k
    offs = tl.arange(0, BLOCK)
    norm_o = tl.zeros((BLOCK,), dtype=tl.float32)
    norm_hat = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(0, k, BLOCK):
        ok = (r0 + offs) < k
        s = tl.load(sumsq_ptr + base + r0 + offs, mask=ok, other=0.0)
        v = tl.load(v_ptr + base + r0 + offs, mask=ok, other=0.0)
        # Correctly rounded / and √ (compiled, Triton's defaults are approximate), as torch computes
        # them: one program per matrix, so the cost is nothing.
        mean = tl.div_rn(s, n)
        v_new = mean + beta2 * (v - mean)  # β₂V + (1−β₂)·mean(O²), as torch.lerp writes it
        tl.store(v_new_ptr + base + r0 + offs, v_new, mask=ok)
        d = tl.sqrt_rn(v_new) + eps
        norm_o += s
        norm_hat += tl.where(ok, tl.div_rn(tl.div_rn(s, d), d), 0.0)  # twice: d² could underflow (torch_backend)
    # ‖O‖/‖Ô‖; Ô = 0 only when O = 0, where the floor keeps 0/0 at 0.
    ratio = tl.div_rn(tl.sqrt_rn(tl.sum(norm_o, axis=0)), tl.maximum(tl.sqrt_rn(tl.sum(norm_hat, axis=0)), tiny))
    for r0 in range(0, k, BLOCK):
        ok = (r0 + offs) < k
        s = tl.load(sumsq_ptr + base + r0 + offs, mask=ok, other=0.0)
        v = tl.load(v_ptr + base + r0 + offs, mask=ok, other=0.0)
        mean = tl.div_rn(s, n)
        v_new = mean + beta2 * (v - mean)  # recomputed: no read-after-write across threads
        coef = tl.div_rn(-step * ratio, tl.sqrt_rn(v_new) + eps)
        # A zero row's factor is 0: with ε ≲ 1e-41 ratio/ε overflows, and 0·inf would be NaN (torch_backend).
        tl.store(coef_ptr + base + r0 + offs, tl.where(s > 0, coef, 0.0), mask=ok)


@triton.jit
def _apply_kernel(
    x_ptr, x_ptrs, o_ptr, index_ptr, position_ptr, coef_ptr,
    m, n, k, decay,
    stride_xb, stride_xm, stride_xn,
    stride_ob, stride_ok, stride_on,
    stride_ib, stride_pb,
    X_IS_LIST: tl.constexpr,
    SELECTED_ONLY: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    batch = tl.program_id(0).to(tl.int64)
    # int64 rows and columns: rows · stride overflows int32 once a matrix holds 2³¹ elements.
    r = tl.program_id(1).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    if SELECTED_ONLY:  # programs walk the selected rows: r is the position in S
        rows = tl.load(index_ptr + batch * stride_ib + r, mask=r < k, other=-1)
        r_ok = rows >= 0  # −1 pads a ragged selection
        pos = r
        selected = r_ok
    else:  # programs walk every parameter row
        r_ok = r < m
        rows = r
        pos = tl.load(position_ptr + batch * stride_pb + r, mask=r_ok, other=-1)
        selected = pos >= 0
    if X_IS_LIST:
        base = tl.load(x_ptrs + batch).to(tl.pointer_type(x_ptr.dtype.element_ty))
    else:
        base = x_ptr + batch * stride_xb
    x_ptrs_tile = base + rows[:, None] * stride_xm + cols[None, :] * stride_xn
    ok = r_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptrs_tile, mask=ok, other=0.0).to(tl.float32)
    coef = tl.load(coef_ptr + batch * k + pos, mask=selected, other=0.0)
    o_tile = o_ptr + batch * stride_ob + pos[:, None] * stride_ok + cols[None, :] * stride_on
    o = tl.load(o_tile, mask=selected[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    new = x * decay + coef[:, None] * o
    tl.store(x_ptrs_tile, to_output(new, x_ptr, EMULATE_BF16), mask=ok)  # the one rounding


_POINTER_CACHE: dict[tuple, Tensor] = {}
_POINTER_CACHE_SIZE = 512


def _pointer_table(xs: Sequence[Tensor]) -> Tensor:
    """The data pointers of ``xs`` as an int64 tensor on their device, cached per pointer tuple.

    Parameters keep their storage across steps, so after the first step no host→device copy (and
    no implicit synchronization) is needed, and the table is stable under CUDA-graph capture.
    """
    key = (xs[0].device, tuple(x.data_ptr() for x in xs))
    table = _POINTER_CACHE.get(key)
    if table is None:
        if len(_POINTER_CACHE) >= _POINTER_CACHE_SIZE:
            _POINTER_CACHE.clear()
        table = torch.tensor(key[1], dtype=torch.int64).to(xs[0].device)
        _POINTER_CACHE[key] = table
    return table


def supported(params: Tensor | Sequence[Tensor]) -> bool:
    """Whether the list of matrices can go to one launch: one dtype, one shape, one set of strides."""
    if isinstance(params, Tensor):
        return True
    first = params[0]
    return all(p.dtype == first.dtype and p.shape == first.shape and p.stride() == first.stride() for p in params)


def dion3_post_update(
    params: Tensor | Sequence[Tensor],
    index: Tensor | Sequence[Tensor],
    o: Tensor,
    v: Tensor | None,
    *,
    lr: float,
    weight_decay: float,
    scale: float,
    beta2: float,
    eps: float,
    normalize: bool = True,
) -> Tensor | None:
    """The fused update (see the module docstring); same contract as the torch reference.

    ``params``: [B, m, n] or B matrices [m, n] of one shape, dtype and layout (updated in place);
    ``index``: [B, k] selected rows (distinct within each matrix), or B 1-D tensors of different
    lengths (ragged; ``o`` and ``v`` zero-padded to the longest); ``o``: [B, k, n];
    ``v``: [B, k] fp32 variance of the selected rows. Returns V' [B, k] (``None`` with
    ``normalize=False``, where O is used as it is and V is not read). Every size must be non-zero
    (the dispatcher in ``orthoptim.kernels`` sends empty problems to the torch reference).
    """
    with device_of(params[0]):
        return _post_update(params, index, o, v, lr=lr, weight_decay=weight_decay, scale=scale, beta2=beta2,
                            eps=eps, normalize=normalize)


def _post_update(params, index, o, v, *, lr, weight_decay, scale, beta2, eps, normalize):
    is_list = not isinstance(params, Tensor)
    first = params[0]
    batch, (m, n), k = o.shape[0], first.shape[-2:], o.shape[1]
    device = first.device
    if isinstance(index, Tensor):
        index = index.contiguous()
    else:  # ragged: pad with −1 to the width of O, which the kernels skip
        index = torch.nn.utils.rnn.pad_sequence(list(index), batch_first=True, padding_value=-1)
        index = torch.nn.functional.pad(index, (0, k - index.shape[1]), value=-1)
    if index.shape != (batch, k):
        raise ValueError(f"index must have shape {(batch, k)} to match O, got {tuple(index.shape)}")
    decay = 1.0 - lr * weight_decay
    step = lr * scale
    position = torch.full((batch, m), -1, dtype=torch.int32, device=device)
    row_blocks = triton.cdiv(k, BLOCK_ROWS)
    if normalize:
        sumsq = torch.empty((batch, k), dtype=torch.float32, device=device)
        v_new = torch.empty((batch, k), dtype=torch.float32, device=device)
        coef = torch.empty((batch, k), dtype=torch.float32, device=device)
        _row_sumsq_kernel[(batch, row_blocks)](
            o, index, position, sumsq, k, n, *o.stride(), index.stride(0), position.stride(0),
            COMPUTE_SUMSQ=True, BLOCK_R=BLOCK_ROWS, BLOCK_N=BLOCK_COLS,
        )  # fmt: skip
        _row_coefficient_kernel[(batch,)](
            sumsq, v.to(torch.float32).contiguous(), v_new, coef, k, float(n), float(step), float(beta2), float(eps),
            torch.finfo(torch.float32).tiny, BLOCK=STATS_BLOCK,
        )  # fmt: skip
    else:
        v_new = None
        coef = torch.full((batch, k), -step, dtype=torch.float32, device=device)
        _row_sumsq_kernel[(batch, row_blocks)](
            o, index, position, coef, k, n, *o.stride(), index.stride(0), position.stride(0),
            COMPUTE_SUMSQ=False, BLOCK_R=BLOCK_ROWS, BLOCK_N=BLOCK_COLS,
        )  # fmt: skip
    selected_only = decay == 1.0
    if is_list:
        x0, table, x_strides = first, _pointer_table(params), (0, *first.stride())
    else:
        x0, table, x_strides = params, index, params.stride()  # table is unused for a 3-D tensor
    grid = (batch, triton.cdiv(k if selected_only else m, BLOCK_ROWS), triton.cdiv(n, BLOCK_COLS))
    _apply_kernel[grid](
        x0, table, o, index, position, coef, m, n, k, float(decay),
        *x_strides, *o.stride(), index.stride(0), position.stride(0),
        X_IS_LIST=is_list, SELECTED_ONLY=selected_only, EMULATE_BF16=emulate_bf16_rounding(first.dtype),
        BLOCK_R=BLOCK_ROWS, BLOCK_N=BLOCK_COLS,
    )  # fmt: skip
    return v_new.to(v.dtype) if v_new is not None else None
