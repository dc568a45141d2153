"""Which backend runs a product: the torch reference, the Triton kernels or QuACK's (optional).

``ORTHOPTIM_KERNELS`` (read at every call, so tests and benchmarks can switch it):

- ``auto`` (default, also when unset or empty): for CUDA tensors whose output side is at least
  ``MIN_TRITON_SIZE``, QuACK's CuTeDSL symmetric GEMMs when ``quack-kernels`` is installed (the
  ``hopper`` extra; fp16/bf16 on sm90+), else Triton when ``triton`` is installed; for bf16/fp32
  CPU tensors whose output side is at least ``MIN_BLOCKED_SIZE``, the blocked products of
  ``cpu_symmetric`` (for X Xᵀ of an X at least ``WIDE_GRAM_ASPECT`` times as wide as tall, already
  from ``MIN_BLOCKED_WIDE_GRAM_SIZE`` on; bf16 on CPUs with AMX tiles only from
  ``AMX_BF16_MIN_BLOCKED_SIZE`` on); torch everywhere else.
- ``quack``: QuACK's kernels wherever they can run, whatever the size; torch for everything else.
- ``torch``: the torch backend everywhere.
- ``blocked``: ``cpu_symmetric`` for every CPU tensor, whatever the size or dtype; torch elsewhere.
- ``triton``: Triton wherever it can run, whatever the size: CUDA tensors, and CPU tensors when the
  Triton kernels were imported under ``TRITON_INTERPRET=1`` (the CPU interpreter, for tests). Torch
  for everything else (e.g. float64). Raises ImportError when ``triton`` is not installed.

The Triton modules are imported lazily, the first time a CUDA tensor (or the ``triton`` override)
asks for them: ``import orthoptim`` never imports triton. Under ``auto``, a Triton kernel that fails
(no C compiler for Triton's launcher, a config that does not compile on this GPU) warns once and its
module is not chosen again in this process (``turn_off_triton``): the torch backend runs instead.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from types import ModuleType

import torch
from torch import Tensor

from orthoptim.caller_warnings import warn_at_caller
from orthoptim.kernels import cpu_dtype

ENV_VAR = "ORTHOPTIM_KERNELS"
CHOICES = ("auto", "torch", "triton", "quack", "blocked")

# Output side (k of a k×k result) from which ``auto`` picks the symmetric Triton kernels on CUDA.
# Below it one or a few tiles per matrix leave most of the GPU idle and cuBLAS wins on launch cost.
# A first guess from the tile arithmetic (128×128 tiles: k = 512 saves 6 of 16 tiles), not yet a
# measurement: benchmarks/gpu_check.sh reports the crossover to calibrate it on a GPU.
MIN_TRITON_SIZE = 512

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What ``auto`` gives the symmetric kernels: fp32 tl.dot runs without tensor cores unless TF32 is on,
# where cuBLAS's fp32 GEMM is the one to beat; fp32 goes there until a GPU run measures otherwise.
AUTO_TRITON_SYMMETRIC_DTYPES = (torch.float16, torch.bfloat16)

# Output side from which ``auto`` computes a CPU tensor's symmetric products block by block
# (``cpu_symmetric``). Measured with benchmarks/cpu_symmetric_bench.py on AMD Zen 4 (bf16 and
# fp32, one and two threads): 1.1-1.8x per product from k = 768 on; 0.6-1.4x at 256-512, where
# the k×k products lose on two threads.
MIN_BLOCKED_SIZE = 768
BLOCKED_DTYPES = (torch.bfloat16, torch.float32)
# On CPUs with AMX tiles (Intel Sapphire Rapids and later) a bf16 GEMM cut into block rows loses more
# rate than the blocks save until k is larger: whole Muon steps with and without the blocked products
# (bf16, one and two threads, measured on a 2-core Sapphire Rapids-class guest) ran 0.95-0.98x at
# k = 512, 0.95x / 1.02x at 768 (Dion3 0.88-0.91x, Gram NS 0.92x), 0.94x / 1.02x at 1024, 1.03x at
# 1536, 1.09-1.10x at 2048. There bf16 products are blocked from this size on, and the wide X Xᵀ
# rule below does not apply to bf16 (0.59x on two threads at k = 512, n = 4k). fp32 keeps the
# general sizes on every CPU (1.1-1.5x from k = 384 on AMX too).
AMX_BF16_MIN_BLOCKED_SIZE = 1536
# Below MIN_BLOCKED_SIZE, X Xᵀ of a wide X (n ≥ WIDE_GRAM_ASPECT·k) is still computed block by
# block from k = MIN_BLOCKED_WIDE_GRAM_SIZE on, in blocks of WIDE_GRAM_BLOCK rows: each block row is
# a GEMM over the long side n, which keeps near the full rate at 128 rows, while the k×k products
# (inner side k) lose there. Measured with benchmarks/cpu_symmetric_bench.py on AMD Zen 4 (bf16 and
# fp32, one and two threads, n = 2k and 4k): 1.10-1.43x at k = 512; at 384, 0.83-0.93x in fp32 on two.
MIN_BLOCKED_WIDE_GRAM_SIZE = 512
WIDE_GRAM_ASPECT = 2
WIDE_GRAM_BLOCK = 128


def requested() -> str:
    """The value of ``ORTHOPTIM_KERNELS`` (``auto`` when unset), validated."""
    value = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not supported; use one of {list(CHOICES)}")
    return value


@cache
def triton_installed() -> bool:
    """Whether ``import triton`` would succeed (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_module(name: str) -> ModuleType:
    """Import ``orthoptim.kernels.<name>`` (a Triton module) on first use."""
    if not triton_installed():
        raise ImportError(
            f"{ENV_VAR}=triton needs the optional dependency 'triton' (pip install triton); it is not installed"
        )
    return importlib.import_module(f"orthoptim.kernels.{name}")


# Triton modules turned off under ``auto`` after a failure: module name → the error.
_triton_off: dict[str, str] = {}


def turn_off_triton(module: str, error: BaseException) -> None:
    """Stop choosing the Triton ``module`` under ``auto`` in this process, with one warning."""
    if module in _triton_off:
        return
    _triton_off[module] = f"{type(error).__name__}: {error}"
    warn_at_caller(
        f"orthoptim: a Triton kernel of orthoptim.kernels.{module} failed ({_triton_off[module]}); "
        f"the torch backend runs its products from now on in this process. Set {ENV_VAR}=triton to "
        f"raise the error instead, or {ENV_VAR}=torch not to try Triton",
        RuntimeWarning)


def _on_cuda(tensors: tuple[Tensor, ...]) -> bool:
    return all(t.is_cuda for t in tensors)


def _triton_can_run(tensors: tuple[Tensor, ...], module: str) -> bool:
    if any(t.dtype not in TRITON_DTYPES for t in tensors):
        return False
    if _on_cuda(tensors):
        return True
    # CPU tensors only run under the interpreter, i.e. when the kernels were built by it.
    return all(t.device.type == "cpu" for t in tensors) and triton_module(module).INTERPRET


def use_quack(*tensors: Tensor, size: int | None = None) -> bool:
    """True when QuACK's symmetric GEMM should run a product of ``tensors`` (output side ``size``)."""
    from orthoptim.kernels import quack_symmetric

    choice = requested()
    if choice == "quack":
        return quack_symmetric.can_run(*tensors)
    if choice != "auto" or (size is not None and size < MIN_TRITON_SIZE):
        return False
    return quack_symmetric.can_run(*tensors)


def use_blocked(*tensors: Tensor, size: int | None = None, inner: int | None = None) -> bool:
    """True when ``cpu_symmetric``'s blocked products should run a product of ``tensors`` (output side
    ``size``; ``inner``: the length of the sums, n for X Xᵀ of a [k, n] X)."""
    choice = requested()
    if choice not in ("auto", "blocked") or not all(t.device.type == "cpu" for t in tensors):
        return False
    # Products written into views (out=) have no autograd: differentiable calls keep bmm.
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if choice == "blocked":
        return True
    if size is None or not all(t.dtype in BLOCKED_DTYPES for t in tensors):
        return False
    if _amx_bf16(tensors):
        return size >= AMX_BF16_MIN_BLOCKED_SIZE
    return size >= MIN_BLOCKED_SIZE or _wide_gram(size, inner)


def _amx_bf16(tensors: tuple[Tensor, ...]) -> bool:
    return any(t.dtype == torch.bfloat16 for t in tensors) and cpu_dtype.amx_tiles()


def _wide_gram(size: int, inner: int | None) -> bool:
    """X Xᵀ below ``MIN_BLOCKED_SIZE`` that ``auto`` still blocks: a wide X from ``MIN_BLOCKED_WIDE_GRAM_SIZE`` on."""
    return inner is not None and MIN_BLOCKED_WIDE_GRAM_SIZE <= size < MIN_BLOCKED_SIZE and \
        inner >= WIDE_GRAM_ASPECT * size


def blocked_gram_rows(size: int, inner: int) -> int | None:
    """Rows per block for a blocked X Xᵀ of output side ``size`` and inner side ``inner``:
    ``WIDE_GRAM_BLOCK`` where ``auto`` blocks it by the wide-X rule, else None (``cpu_symmetric.BLOCK``,
    also for every product that ``ORTHOPTIM_KERNELS=blocked`` forces)."""
    return WIDE_GRAM_BLOCK if requested() == "auto" and _wide_gram(size, inner) else None


def use_triton(*tensors: Tensor, size: int | None = None, module: str) -> bool:
    """True when the Triton ``module`` should run a product of ``tensors`` (output side ``size``)."""
    choice = requested()
    if choice in ("torch", "quack", "blocked"):
        return False
    if choice == "triton":
        return _triton_can_run(tensors, module)
    if module in _triton_off or not triton_installed() or not _on_cuda(tensors):
        return False
    if size is not None and size < MIN_TRITON_SIZE:
        return False
    if module == "triton_symmetric" and any(t.dtype not in AUTO_TRITON_SYMMETRIC_DTYPES for t in tensors):
        return False
    return _triton_can_run(tensors, module)
