"""How one parameter tensor is seen as a batch of matrices.

A parameter becomes [batch, rows, cols]: 2-D as is, 3-D as a batch of matrices (e.g. MoE experts),
conv weights flattened to [out, in·kh·kw] with ``flatten=True``. Rows are output features, as
``nn.Linear`` stores them; ``transpose=True`` reads each stored matrix transposed, for weights kept
as [in, out] (used as ``x @ W``: experts stored [E, in, out], GPT-2's Conv1D, transposed convs).
Its rows may then be cut into blocks that are orthogonalized separately: ``split_sizes`` (fused QKV
or gate/up projections) and ``num_heads`` (one matrix per attention head, inside each split).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class MatrixView:
    """The matrix layout of one parameter: ``batch`` stacked [rows, cols] matrices, cut into row blocks."""

    shape: tuple[int, ...]
    batch: int
    rows: int
    cols: int
    blocks: tuple[tuple[int, int], ...]  # (first row, number of rows) of each block
    transposed: bool = False  # each stored matrix is [cols, rows]

    @property
    def num_matrices(self) -> int:
        return self.batch * len(self.blocks)

    def as_batch(self, t: Tensor) -> Tensor:
        """``t`` (shaped like the parameter) as a [batch, rows, cols] view."""
        if self.transposed:
            return t.view(self.batch, self.cols, self.rows).mT
        return t.view(self.batch, self.rows, self.cols)

    def matrices(self, t: Tensor) -> list[Tensor]:
        """In-place-writable [block_rows, cols] views of ``t`` (shaped like the parameter)."""
        t3 = self.as_batch(t)
        return [t3[b, start : start + size] for b in range(self.batch) for start, size in self.blocks]

    def row_vectors(self, v: Tensor) -> list[Tensor]:
        """[block_rows] views of a per-row state tensor of shape [batch, rows]."""
        return [v[b, start : start + size] for b in range(self.batch) for start, size in self.blocks]

    def block_shapes(self) -> list[tuple[int, int]]:
        return [(size, self.cols) for _ in range(self.batch) for _, size in self.blocks]

    def describe(self) -> str:
        """``[m, n]``, ``4 × [m, n]``, or per block size: ``8 × [8, 64] + 4 × [16, 64]``."""
        counts: dict[int, int] = {}
        for _, size in self.blocks:
            counts[size] = counts.get(size, 0) + self.batch
        mark = " (transposed)" if self.transposed else ""
        if self.num_matrices == 1:
            return f"[{self.blocks[0][1]}, {self.cols}]{mark}"
        return " + ".join(f"{n} × [{size}, {self.cols}]" for size, n in sorted(counts.items())) + mark


def matrix_view(
    shape: Sequence[int],
    *,
    name: str,
    flatten: bool = False,
    num_heads: int | None = None,
    split_sizes: Sequence[int] | None = None,
    transpose: bool = False,
) -> MatrixView:
    """Validate the group options for a parameter of ``shape`` and return its matrix layout.

    Raises ValueError naming ``name`` and the fix when the options do not fit the shape.
    """
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        raise ValueError(
            f"parameter {name} has shape {shape}: a matrix rule needs at least 2 dims; "
            "put it in a group with algorithm='adamw' or 'lion' (orthoptim.param_groups does this)"
        )
    if flatten and len(shape) > 2:
        batch, rows, cols = 1, shape[0], math.prod(shape[1:])
    elif len(shape) == 2:
        batch, rows, cols = 1, shape[0], shape[1]
    elif len(shape) == 3:
        batch, rows, cols = shape
    else:
        raise ValueError(
            f"parameter {name} has shape {shape}: tensors with more than 3 dims need flatten=True "
            "in their group (conv weights become [out, in·kh·kw])"
        )
    if rows == 0 or cols == 0:
        raise ValueError(f"parameter {name} has shape {shape} with an empty matrix dimension: a matrix rule has "
                         "nothing to orthogonalize; leave it out of the optimizer, or put it in a group with "
                         "algorithm='adamw'")
    if transpose:  # split_sizes and num_heads below cut the transposed matrix's rows
        rows, cols = cols, rows

    if split_sizes is not None:
        splits = [int(s) for s in split_sizes]
        if any(s <= 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"parameter {name}: split_sizes={list(split_sizes)} must be positive and sum to its "
                f"{rows} rows; set split_sizes to the row counts of the fused blocks (e.g. [q, k, v])"
            )
    else:
        splits = [rows]
    if num_heads is not None:
        if int(num_heads) <= 0 or any(s % int(num_heads) for s in splits):
            where = f"each split of {splits}" if split_sizes is not None else f"its {rows} rows"
            raise ValueError(
                f"parameter {name}: num_heads={num_heads} must divide {where}; "
                "set num_heads to the head count of this projection or remove it"
            )
    heads = int(num_heads) if num_heads is not None else 1
    blocks = []
    start = 0
    for split in splits:
        size = split // heads
        for _ in range(heads):
            blocks.append((start, size))
            start += size
    return MatrixView(shape=shape, batch=batch, rows=rows, cols=cols, blocks=tuple(blocks), transposed=transpose)
