"""Triton kernels for the symmetric products of Gram Newton-Schulz.

One kernel, ``alpha · A Bᵀ + beta · C + diag · I`` for batches A, B of shape [B, M, K] (C: [B, M, M]),
for the case where the result is known to be symmetric. Only the tiles on and below the diagonal
are computed; each off-diagonal tile is stored twice (once transposed), so about half the FLOPs of a
full product are spent and the result is exactly symmetric. Accumulation is in fp32; inputs may be
fp16, bf16 or fp32 and the result has the inputs' dtype.

The three products of the iteration are all of this form:

- ``gram(X)``: X Xᵀ (A = B = X, K = n).
- ``symmetric_polynomial(R, a, b, c)``: a I + b R + c R², with R² = R Rᵀ because R is symmetric.
- ``symmetric_product(P, Q)``: P Q for symmetric P, Q that commute (polynomials in the same R), so
  P Q is symmetric and equals P Qᵀ.

Importing this module needs ``triton``; see ``triton_common`` for the CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from orthoptim.kernels.triton_common import INTERPRET, device_of, emulate_bf16_rounding, to_output

# Tile sizes the interpreter runs with (and tests may choose): small, so ragged edges are exercised.
INTERPRETER_BLOCK = 16
INTERPRETER_BLOCK_K = 16


# Shared memory per block on Hopper (H100/H200): 227 KiB.
SHARED_MEMORY_BYTES = 227 * 1024
# CUDA caps the second and third grid dimensions at 65535: larger batches are launched in chunks.
MAX_GRID_BATCH = 65535


# Every autotuned config reads K in steps of this depth, so an entry's bits cannot depend on which config
# autotuning (a timing race in each process) picks. Where the depth orders the fp32 sums (the
# interpreter: depths of 32 and 128 next to 64 gave other bits in 2/3 of an fp32 product's entries;
# compiled code may chain them across K steps instead) that matters; elsewhere it costs nothing.
AUTOTUNE_BLOCK_K = 64


def _autotune_configs() -> list[triton.Config]:
    """Square output tiles for Hopper (H100/H200): 64 or 128 rows, ``AUTOTUNE_BLOCK_K`` deep, 3–5 stages.

    128×128 fp32 accumulators need 8 warps (with 4, ptxas spills: 255 registers, 360 bytes in
    benchmarks/kernels_sm90_compile.py); 64×64 tiles keep enough programs in flight when k is small
    (one matrix of k = 512 has only 10 lower tiles of 128). With 16-bit inputs all fit in shared
    memory (at most 160 KiB); ``_fits_in_shared_memory`` drops, per input dtype, those that cannot
    (fp32 inputs take twice the buffers: 128 rows × 4 stages need 256 KiB).
    """
    shapes = [(128, 3, 8), (128, 4, 8), (128, 5, 8), (64, 3, 4), (64, 4, 4), (64, 5, 4)]
    return [
        triton.Config({"BLOCK": block, "BLOCK_K": AUTOTUNE_BLOCK_K}, num_stages=stages, num_warps=warps)
        for block, stages, warps in shapes
    ]


def shared_memory_bytes(block: int, block_k: int, stages: int, itemsize: int) -> int:
    """Both operands' pipeline buffers: an upper bound of what Triton 3.9 allocates for sm_90a (equal for
    16-bit inputs, one buffer more than it uses for fp32; benchmarks/kernels_sm90_compile.py reports it)."""
    return stages * 2 * block * block_k * itemsize


def _fits_in_shared_memory(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """Autotuner pre-filter: compiling a config that cannot fit only costs time (seconds each)."""
    itemsize = named_args["a_ptr"].element_size()
    fitting = [c for c in configs if shared_memory_bytes(c.kwargs["BLOCK"], c.kwargs["BLOCK_K"], c.num_stages,
                                                         itemsize) <= SHARED_MEMORY_BYTES]
    return fitting or configs[-1:]


@triton.jit
def _lower_tile(pid):
    """Program id → (i, j) with i ≥ j, enumerating the lower triangle row by row: 0→(0,0), 1→(1,0)…"""
    i = ((tl.sqrt(8.0 * pid.to(tl.float32) + 1.0) - 1.0) * 0.5).to(tl.int32)
    # Correct the float estimate by one step either way (exact for any realistic tile count).
    i = tl.where(i * (i + 1) // 2 > pid, i - 1, i)
    i = tl.where((i + 1) * (i + 2) // 2 <= pid, i + 1, i)
    return i, pid - i * (i + 1) // 2


@triton.jit
def _syrk_kernel(
    a_ptr, b_ptr, c_ptr, out_ptr,
    M, K,
    alpha, beta, diag,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bm, stride_bk,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    HAS_C: tl.constexpr,
    DOT_FP32: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    ti, tj = _lower_tile(tl.program_id(0))
    batch = tl.program_id(1).to(tl.int64)
    rows = ti * BLOCK + tl.arange(0, BLOCK)
    cols = tj * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < M
    # The tile's first row and column as int64 offsets (rows · stride overflows int32 once a matrix
    # holds 2³¹ elements); the offsets within a tile stay int32, which keeps registers free.
    i = tl.arange(0, BLOCK)
    row0 = (ti * BLOCK).to(tl.int64)
    col0 = (tj * BLOCK).to(tl.int64)

    # Tile (ti, tj) of A Bᵀ: rows `rows` of A against rows `cols` of B, both read along K.
    a_ptrs = a_ptr + (batch * stride_ab + row0 * stride_am) + i[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + (batch * stride_bb + col0 * stride_bm) + i[:, None] * stride_bm + ks[None, :] * stride_bk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:  # the CPU interpreter cannot multiply bf16 (it stores the bits as uint16)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out = acc * alpha
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_C:
        c_base = c_ptr + (batch * stride_cb + row0 * stride_cm + col0 * stride_cn)
        c_ptrs = c_base + i[:, None] * stride_cm + i[None, :] * stride_cn
        out += beta * tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    out += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    out = to_output(out, out_ptr, EMULATE_BF16)

    # Only the lower half of a tile is stored as computed, and mirrored above the diagonal: below the
    # diagonal that is the whole tile; a diagonal tile of A Bᵀ is symmetric only up to round-off (exactly
    # so when A = B), and mirroring its lower half too makes every entry the same whatever the tile
    # size (autotuning may pick another one in each process).
    lower = rows[:, None] >= cols[None, :]
    o_base = out_ptr + batch * stride_ob
    tl.store(o_base + (row0 * stride_om + col0 * stride_on) + i[:, None] * stride_om + i[None, :] * stride_on, out,
             mask=mask & lower)
    mirror = mask & (rows[:, None] > cols[None, :])
    tl.store(o_base + (col0 * stride_om + row0 * stride_on) + i[:, None] * stride_om + i[None, :] * stride_on,
             tl.trans(out), mask=tl.trans(mirror))


# Tuned per size, dtype, C or not (symmetric_polynomial reads C, the other products do not) and layout
# (stride_ak is 1 for rows read along K, else the transposed read of a tall matrix's Xᵀ X).
_syrk_tuned = triton.autotune(configs=_autotune_configs(), key=["M", "K", "HAS_C", "stride_ak"],
                              prune_configs_by={"early_config_prune": _fits_in_shared_memory})(_syrk_kernel)


def _num_lower_tiles(m: int, block: int) -> int:
    t = triton.cdiv(m, block)
    return t * (t + 1) // 2


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's matmul setting: exact fp32 ("ieee") unless TF32 is allowed."""
    if dtype == torch.float32 and not tf32_allowed():
        return "ieee"
    return "tf32"


def tf32_allowed() -> bool:
    """Whether torch lets fp32 CUDA matmuls use TF32, by whichever API set it.

    torch >= 2.9 has ``fp32_precision`` ("none" inherits the global ``torch.backends`` one); once it
    is set, reading the legacy ``allow_tf32`` raises, so the legacy flag is read only before 2.9.
    """
    matmul = torch.backends.cuda.matmul
    setting = getattr(matmul, "fp32_precision", None)
    if setting is None:
        return bool(matmul.allow_tf32)
    if setting == "none":
        setting = getattr(torch.backends, "fp32_precision", "none")
    return setting == "tf32"


def _check_tile(name: str, value: int) -> None:
    # tl.dot needs every side >= 16, and tl.arange powers of two; the interpreter checks neither.
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"syrk: {name}={value!r} must be a power of two >= 16")


def syrk(
    a: Tensor,
    b: Tensor,
    *,
    alpha: float = 1.0,
    c: Tensor | None = None,
    beta: float = 0.0,
    diag: float = 0.0,
    block: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> Tensor:
    """alpha · A Bᵀ + beta · C + diag · I for batches [B, M, K], computing only the lower tiles.

    The caller guarantees that the result is symmetric (otherwise the upper triangle is simply the
    mirror of the lower one). ``block``/``block_k`` pick one tile shape (the interpreter and tests);
    by default on GPU the tile shape is autotuned per (M, K, dtype, C or not, layout).
    """
    if a.ndim != 3 or b.shape != a.shape:
        raise ValueError(f"syrk needs two batches of the same shape [B, M, K], got {tuple(a.shape)}, {tuple(b.shape)}")
    if a.dtype != b.dtype or (c is not None and c.dtype != a.dtype):
        raise ValueError("syrk needs inputs of one dtype")
    batch, m, k = a.shape
    if c is not None and c.shape != (batch, m, m):
        raise ValueError(f"syrk: C must have shape {(batch, m, m)}, got {tuple(c.shape)}")
    out = torch.empty((batch, m, m), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if block is not None:
        block_k = block_k or block
        _check_tile("block", block)
        _check_tile("block_k", block_k)
    flags = {
        "HAS_C": c is not None,
        "DOT_FP32": INTERPRET and a.dtype == torch.bfloat16,
        "EMULATE_BF16": emulate_bf16_rounding(a.dtype),
        "PRECISION": _precision(a.dtype),
    }
    if INTERPRET and block is None:
        block, block_k = INTERPRETER_BLOCK, INTERPRETER_BLOCK_K
    with device_of(a):
        for start in range(0, batch, MAX_GRID_BATCH):
            part = slice(start, start + MAX_GRID_BATCH)
            a_part, b_part, out_part = a[part], b[part], out[part]
            c_part = c[part] if c is not None else out_part  # never read when HAS_C is False
            args = (
                a_part, b_part, c_part, out_part, m, k, float(alpha), float(beta), float(diag),
                *a.stride(), *b.stride(), *c_part.stride(), *out.stride(),
            )  # fmt: skip
            chunk = out_part.shape[0]
            if block is not None:
                grid = (_num_lower_tiles(m, block), chunk)
                _syrk_kernel[grid](*args, **flags, BLOCK=block, BLOCK_K=block_k, num_warps=num_warps)
            else:
                _syrk_tuned[lambda meta, chunk=chunk: (_num_lower_tiles(m, meta["BLOCK"]), chunk)](*args, **flags)
    return out


def gram(x: Tensor, **config) -> Tensor:
    """X Xᵀ for a batch [B, k, n] → [B, k, k]."""
    return syrk(x, x, **config)


def symmetric_polynomial(r: Tensor, a: float, b: float, c: float, **config) -> Tensor:
    """a I + b R + c R² for a batch of symmetric R [B, k, k]."""
    return syrk(r, r, alpha=c, c=r, beta=b, diag=a, **config)


def symmetric_product(p: Tensor, q: Tensor, **config) -> Tensor:
    """P Q for batches of symmetric, commuting P, Q [B, k, k] (so P Q is symmetric)."""
    return syrk(p, q, **config)
