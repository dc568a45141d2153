"""Whole copies of many sharded tensors with one set of collectives per layout.

``DTensor.full_tensor()`` gathers one tensor at a time: for a model's TP-sharded matrices that is one
collective per matrix and per state tensor. Tensors that share a shape, dtype, mesh and placements
are stacked along a new leading dim (each placement ``Shard(d)`` becomes ``Shard(d + 1)``), so
that one ``full_tensor()`` of the stack gathers them all. ``Gathered``: the whole momentum,
gradient and row variance of a sharded matrix for the step's "gathered" layout, and the write-back
of each rank's block.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from orthoptim import rules
from orthoptim.distributed.comm import CommStats
from orthoptim.distributed.dtensor import distribute_tensor
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


class Gathered:
    """Whole copies of a sharded matrix's momentum, gradient and row variance for one step.

    The rule runs on these with a zero "parameter" that collects the update (its weight decay is
    applied on the shard directly); ``write_back`` keeps each rank's block. ``gather_all`` builds
    them for many parameters with one set of collectives per layout.
    """

    def __init__(self, p: Tensor, state: dict[str, Any], momentum: Tensor, grad: Tensor, variance: Tensor | None):
        self.p, self.state = p, state
        self.momentum, self.grad, self.variance = momentum, grad, variance
        # fp16/bf16 parameters collect their update in fp32: write_back then decays and adds in fp32 and
        # rounds once, as the single-process rules do (rules.weight_decay.ROUNDED_ONCE).
        self.delta = torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                 device=self.momentum.device)

    @classmethod
    def gather_all(cls, params: list[Tensor], states: list[dict[str, Any]],
                   stats: CommStats | None) -> list[Gathered]:
        with_variance = [s for s in states if "variance" in s]
        whole = full_tensors([s["momentum"] for s in states] + [p.grad for p in params]
                             + [s["variance"] for s in with_variance], stats)
        n = len(params)
        variances = iter(whole[2 * n:])
        return [cls(p, s, whole[i], whole[n + i], next(variances) if "variance" in s else None)
                for i, (p, s) in enumerate(zip(params, states))]

    @staticmethod
    def _block(full: Tensor, like: Tensor) -> Tensor:
        # Slicing only (src_data_rank=None): every rank already holds the same whole tensor.
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()

    def write_back(self, lr: float | Tensor, weight_decay: float) -> None:
        local = self.p.to_local()
        # X ← X·(1 − lr·wd) + delta; looked up per call: step_phases wraps it
        rules.weight_decay.decay_and_apply_([local], self._block(self.delta, self.p)[None], lr, weight_decay, -1.0)
        self.state["momentum"].to_local().copy_(self._block(self.momentum, self.p))
        if self.variance is not None:
            self.state["variance"].to_local().copy_(self._block(self.variance, self.state["variance"]))
