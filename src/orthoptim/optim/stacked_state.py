"""The state of a megabatch's matrices as views of one tensor, so that row selection runs batched.

Each parameter owns its state tensors, so the B matrices of a megabatch have B separate momenta,
and Dion2/Dion3's row selection (M ← M + G with the rows' norms, the gather of the selected rows,
their error-feedback decay, the variance rows) costs a few small ops per matrix: on a GPU B kernel
launches each, on a CPU B dispatches, which for small matrices cost more than the arithmetic.
Once the B state tensors are views of one [B, ...] buffer (made as zeros when the group is added;
``restack`` copies standalone state of an older pickle into one), those ops run once for the batch,
with the same elementwise arithmetic and row reductions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def stacked_view(tensors: list[Tensor]) -> Tensor | None:
    """A [B, *shape] view whose i-th entry is ``tensors[i]`` (same shape, strides, dtype and device),
    if they lie equally spaced and without overlap in one storage; else None."""
    t0 = tensors[0]
    if len(tensors) == 1:
        return t0.unsqueeze(0)
    shape, strides, storage, offset = t0.shape, t0.stride(), t0.untyped_storage().data_ptr(), t0.storage_offset()
    spacing = tensors[1].storage_offset() - offset
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))  # elements one view spans
    if spacing < extent or any(stride < 0 for stride in strides):
        return None
    for i, t in enumerate(tensors):
        if (t.shape != shape or t.stride() != strides or t.dtype != t0.dtype or t.device != t0.device
                or t.storage_offset() != offset + i * spacing or t.untyped_storage().data_ptr() != storage):
            return None
    return t0.as_strided((len(tensors), *shape), (spacing, *strides), offset)


def restack(tensors: list[Tensor]) -> list[Tensor]:
    """Copies of ``tensors`` (one shape) that are views of one new contiguous [B, *shape] tensor."""
    return list(torch.stack(tensors).unbind(0))


def stands_alone(t: Tensor) -> bool:
    """Whether ``t`` is the whole of its storage (not a view into a stack)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


@dataclass(frozen=True)
class StackView:
    """How a view into a stack is pickled or deep-copied: the stack itself (one object for all of its
    views, so pickle's and deepcopy's memo write and copy it once) and where in it the view lies.
    (A tensor view pickles its whole storage, once per view.)"""

    base: Tensor
    offset: int  # elements from the start of ``base``
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def view(self) -> Tensor:
        return self.base.as_strided(self.shape, self.stride, self.base.storage_offset() + self.offset)


def for_copying(value: Any) -> Any:
    """A state entry as ``__getstate__`` hands it over: a view into a stack as a ``StackView``, another
    view of part of a storage as a copy of its own; anything else as it is."""
    if type(value) is not Tensor or stands_alone(value):
        return value
    base = value._base  # the root of a view chain
    # A stack as the library makes one ([B, *shape], unbound); a view of another buffer goes as a copy.
    if type(base) is Tensor and base.dtype == value.dtype and tuple(base.shape[1:]) == tuple(value.shape):
        return StackView(base, value.storage_offset() - base.storage_offset(), tuple(value.shape), value.stride())
    return value.clone()


def from_copying(value: Any) -> Any:
    """The inverse of ``for_copying`` (after unpickling or deep-copying)."""
    return value.view() if isinstance(value, StackView) else value
