"""Whole copies of many sharded tensors with one set of collectives per layout.

``DTensor.full_tensor()`` gathers one tensor at a time: for a model's TP-sharded matrices that is one
collective per matrix and per state tensor. Tensors that share a shape, dtype, mesh and placements
are stacked along a new leading dim (each placement ``Shard(d)`` becomes ``Shard(d + 1)``), so
that one ``full_tensor()`` of the stack gathers them all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from orthoptim.distributed.comm import CommStats
from orthoptim.distributed.megabatch import megabatches


def _stackable(t) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return all(isinstance(pl, Replicate) or type(pl) is Shard for pl in t.placements)


def _sharded(t) -> bool:
    from torch.distributed.tensor import Replicate

    return any(not isinstance(pl, Replicate) for pl in t.placements)


def full_tensors(tensors: list, stats: CommStats | None = None) -> list[Tensor]:
    """``[t.full_tensor() for t in tensors]`` (contiguous), batching same-layout tensors together."""
    from torch.distributed.tensor import DTensor, Shard

    out: list[Tensor | None] = [None] * len(tensors)
    order = list(range(len(tensors)))

    def key(i: int) -> tuple:
        t = tensors[i]
        stack = _stackable(t) and _sharded(t)
        return (stack, tuple(t.shape), t.dtype, t.device_mesh, tuple(t.placements)) if stack else ("one", i)

    for batch in megabatches(order, key=key):
        first = tensors[batch[0]]
        if not _sharded(first):  # replicated: every rank already holds it
            for i in batch:
                out[i] = tensors[i].to_local().contiguous()
            continue
        if stats is not None:
            stats.record("all_gather", sum(tensors[i].to_local().numel() for i in batch) * first.element_size())
        if len(batch) == 1 or not _stackable(first):
            for i in batch:
                out[i] = tensors[i].full_tensor().contiguous()
            continue
        local = torch.stack([tensors[i].to_local() for i in batch])
        placements = [Shard(pl.dim + 1) if isinstance(pl, Shard) else pl for pl in first.placements]
        shape = (len(batch), *first.shape)
        stride = torch.empty(shape, device="meta").stride()
        whole = DTensor.from_local(local, first.device_mesh, placements, run_check=False, shape=torch.Size(shape),
                                   stride=stride).full_tensor()
        for j, i in enumerate(batch):
            out[i] = whole[j]
    return out  # type: ignore[return-value]
