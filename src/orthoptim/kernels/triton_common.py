"""What the Triton kernel modules share: the interpreter switch and rounding to the output dtype.

Importing this module needs ``triton``. For Triton's CPU interpreter, ``TRITON_INTERPRET=1`` must be
set before ``triton`` itself is first imported (its library functions, e.g. ``tl.zeros``, are jitted
then) and still be set when the kernel modules are imported and run; ``INTERPRET`` records the mode
the kernels here were built in.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

try:
    from triton import knobs as _knobs

    INTERPRET = bool(_knobs.runtime.interpret)
except ImportError:  # triton < 3.4 has no knobs; the decorator reads the environment directly
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

_LIBRARY_MODE = type(tl.zeros).__name__
if _LIBRARY_MODE in ("JITFunction", "InterpretedFunction") and (_LIBRARY_MODE == "InterpretedFunction") != INTERPRET:
    raise ImportError(
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} differs from when triton was imported; "
        "set TRITON_INTERPRET=1 before the first `import triton` (and keep it set) to use the CPU interpreter"
    )


def device_of(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make ``x``'s GPU the current one: Triton launches on the current device (and its current
    stream), not on the inputs' device."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def emulate_bf16_rounding(dtype: torch.dtype) -> bool:
    """True where ``x.to(tl.bfloat16)`` would not round to nearest even: the interpreter truncates."""
    return INTERPRET and dtype == torch.bfloat16


@triton.jit
def to_output(x, out_ptr, EMULATE_BF16: tl.constexpr):
    """fp32 ``x`` in the element type of ``out_ptr``, rounded to nearest even.

    On a GPU the conversion instruction does this. Triton's CPU interpreter truncates fp32 → bf16,
    so there (EMULATE_BF16) the rounding is done on the bits: add 0x7FFF plus the lowest kept bit,
    then drop the low 16 bits (finite values; NaN stays NaN for the canonical NaN).
    """
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(out_ptr.dtype.element_ty)
