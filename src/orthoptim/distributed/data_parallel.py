"""Replicated parameters (DDP): every rank holds the whole batch, each computes a share of it.

The gradient is already averaged by DDP, so the momentum, the row selection and the batch to
orthogonalize are identical on every rank. Rank r computes matrices [r·c, (r+1)·c) of the batch,
padded to c·world (c = ceil(B / world)) with copies of its first matrix, and one all-gather returns the whole result to
everyone: no work is repeated, one collective per megabatch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.comm import CommStats, all_gather_batch


def _pad(batch: Tensor | list[Tensor], pad: int) -> Tensor | list[Tensor]:
    # Copies of the first entry, not zeros: the padding is computed and dropped, and a function
    # that cannot take a zero matrix (a user's orthogonalizer without an eps) must not fail on it.
    if isinstance(batch, Tensor):
        return torch.cat([batch, batch[:1].expand(pad, *batch.shape[1:])])
    return list(batch) + [batch[0]] * pad


def split_batch(fn: Callable[..., Tensor], group: dist.ProcessGroup,
                stats: CommStats | None) -> Callable[..., Tensor]:
    """Wrap ``fn(x, *more) → [B, ...]``, whose inputs are batches (a [B, ...] tensor or a list of B
    tensors) and which treats each batch entry on its own (as every orthogonalizer does), so that
    each rank computes its share and all ranks receive the whole result."""
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)

    def run(*inputs: Tensor | list[Tensor]) -> Tensor:
        batch = len(inputs[0])
        chunk = -(-batch // world)
        pad = chunk * world - batch
        if pad:
            inputs = tuple(_pad(t, pad) for t in inputs)
        mine = fn(*(t[rank * chunk : (rank + 1) * chunk] for t in inputs))
        return all_gather_batch(mine, group, stats)[:batch]

    return run
