"""Collectives used by the execution plan, each counted in an opt-in ``CommStats``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

# Newer torch renamed all_gather_into_tensor and reduce_scatter_tensor (same arguments) and warns on
# the old names; use whichever this torch has.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_single(output: Tensor, input: Tensor, **kwargs) -> object:
    """torch.distributed's reduce-scatter into one tensor, looked up at each call (as FSDP2 looks it up,
    so that a wrapped one is the one called)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, **kwargs)


@dataclass
class CommStats:
    """Counts of collectives and the bytes each rank contributes, per kind (e.g. "all_gather").

    Attach to an optimizer with ``opt.comm_stats = CommStats()``; call ``reset()`` before a step to
    read that step's numbers.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def record(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += int(nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


def all_gather_batch(local: Tensor, group: dist.ProcessGroup, stats: CommStats | None) -> Tensor:
    """Concatenate every rank's equally shaped ``local`` [b, ...] along dim 0, in rank order."""
    world = dist.get_world_size(group)
    local = local.contiguous()
    out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    _all_gather_single(out, local, group=group)
    if stats is not None:
        stats.record("all_gather", local.numel() * local.element_size())
    return out


def all_reduce(t: Tensor, group: dist.ProcessGroup | None, stats: CommStats | None, op: str = "sum") -> Tensor:
    """Sum (or, ``op="mean"``, average) ``t`` in place over ``group``; no group: ``t`` unchanged."""
    if group is None:
        return t
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    if op == "mean":
        t /= dist.get_world_size(group)
    if stats is not None:
        stats.record("all_reduce", t.numel() * t.element_size())
    return t
