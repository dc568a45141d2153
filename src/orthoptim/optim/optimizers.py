"""The public optimizer classes. Each one only chooses defaults; any group may still pick any
``algorithm`` (so one optimizer serves matrices and the AdamW/Lion groups of a model).

Every class takes ``capturable=True`` for CUDA-graph capture (``orthoptim.CapturedStep``): learning
rates become 0-dim device tensors (LR schedulers fill them in place), AdamW's step count lives on the
device, and the step never reads a value back to the host. Non-finite gradients are then flagged,
not refused: ``optimizer.check_nonfinite()`` raises afterwards, naming the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from orthoptim.distributed import resolve_process_group
from orthoptim.optim.base import OrthonormalOptimizer

Params = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]
OrthogonalizerSpec = str | Callable[[Tensor], Tensor] | None


class Dion3(OrthonormalOptimizer):
    """Dion3: each step orthogonalizes only the ``fraction`` of momentum rows with the largest L1
    norm (Gram Newton-Schulz; standard Newton-Schulz when it iterates in bf16, where Gram NS is
    unstable), normalizes them per neuron, and keeps the rest in momentum
    (error feedback). See ``orthoptim.rules.dion3``."""

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        fraction: float = 0.25,
        mu: float = 0.95,
        muon_beta2: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: str | None = "spectral_norm",
        orthogonalizer: OrthogonalizerSpec = "gram",
        flatten: bool = False,
        nonfinite: str = "raise",
        capturable: bool = False,
        selection_scope: str = "local",
        distributed_mesh: Any = None,
    ) -> None:
        super().__init__(params, dict(
            algorithm="dion3", lr=lr, fraction=fraction, mu=mu, muon_beta2=muon_beta2, betas=betas,
            weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr, orthogonalizer=orthogonalizer,
            flatten=flatten, nonfinite=nonfinite, selection_scope=selection_scope,
        ), distributed_mesh=distributed_mesh, capturable=capturable)


class Dion2(OrthonormalOptimizer):
    """Dion2: orthogonalize the ``fraction`` of rows or columns (shorter side) of the momentum with
    the largest L1 norm; ``mu`` is the error-feedback decay of the selected slices."""

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        fraction: float = 0.25,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: str | None = "spectral_norm",
        orthogonalizer: OrthogonalizerSpec = "polar_express",
        flatten: bool = False,
        nonfinite: str = "raise",
        capturable: bool = False,
        selection_scope: str = "local",
        distributed_mesh: Any = None,
    ) -> None:
        super().__init__(params, dict(
            algorithm="dion2", lr=lr, fraction=fraction, mu=mu, betas=betas, weight_decay=weight_decay,
            epsilon=epsilon, adjust_lr=adjust_lr, orthogonalizer=orthogonalizer, flatten=flatten,
            nonfinite=nonfinite, selection_scope=selection_scope,
        ), distributed_mesh=distributed_mesh, capturable=capturable)


class Muon(OrthonormalOptimizer):
    """Muon: momentum, orthogonalized by Newton-Schulz (Polar Express coefficients by default)."""

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        mu: float = 0.95,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: str | None = "spectral_norm",
        orthogonalizer: OrthogonalizerSpec = "polar_express",
        flatten: bool = False,
        nonfinite: str = "raise",
        capturable: bool = False,
        distributed_mesh: Any = None,
    ) -> None:
        super().__init__(params, dict(
            algorithm="muon", lr=lr, mu=mu, nesterov=nesterov, betas=betas, weight_decay=weight_decay,
            epsilon=epsilon, adjust_lr=adjust_lr, orthogonalizer=orthogonalizer, flatten=flatten,
            nonfinite=nonfinite,
        ), distributed_mesh=distributed_mesh, capturable=capturable)


class NorMuon(OrthonormalOptimizer):
    """NorMuon: Muon with per-neuron (row) second-moment normalization of the orthogonalized update."""

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        mu: float = 0.95,
        muon_beta2: float = 0.95,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: str | None = "spectral_norm",
        orthogonalizer: OrthogonalizerSpec = "polar_express",
        flatten: bool = False,
        nonfinite: str = "raise",
        capturable: bool = False,
        distributed_mesh: Any = None,
    ) -> None:
        super().__init__(params, dict(
            algorithm="normuon", lr=lr, mu=mu, muon_beta2=muon_beta2, nesterov=nesterov, betas=betas,
            weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr, orthogonalizer=orthogonalizer,
            flatten=flatten, nonfinite=nonfinite,
        ), distributed_mesh=distributed_mesh, capturable=capturable)


class Dion(OrthonormalOptimizer):
    """Dion: rank-r orthonormal updates (r = ceil(rank_fraction·min(m, n))) by one step of power
    iteration per optimizer step, with error feedback of what the low-rank update leaves out.

    A column of ``R = BᵀP`` that is zero (all of B zero: a zero gradient on the first step, an expert
    without tokens) keeps its column of Q. The rule assumes B has rank ≥ r: beyond B's rank, P's
    columns are rounding noise and column normalization makes their R columns unit-norm, as in the
    published rule, so for a momentum of rank below r (a batch of a few samples) the update can have
    singular values above 1 in directions set by rounding; a smaller ``rank_fraction`` avoids it.

    ``outer_shard_mesh`` (FSDP2) and ``inner_shard_mesh`` (tensor parallelism): the 1-D meshes that
    shard parameters, along rows (``Shard(0)``) or columns (``Shard(1)``), one dim each; both at once
    is 2-D sharding. Matrices are never assembled: only m×r, n×r and r×r factors are all-reduced.
    A matrix sharded twice along the same dim is refused. ``replicate_mesh``: data parallelism
    without DDP — do not all-reduce gradients yourself: Dion matrices all-reduce ``B Q`` and ``Bᵀ P``
    (compressed sync, the same result as averaging gradients first) and this optimizer averages
    every other gradient. Each rank then keeps its own momentum, whose mean is the synchronized one;
    every ``replica_sync_every`` steps (and in ``state_dict()``, which is then a collective) the
    momenta are set to their mean, one all-reduce, which changes no update but keeps what each rank
    holds beyond the mean (a sum of its gradients' deviations, never decayed) from swamping bf16
    momenta. ``distributed_mesh``: the other optimizers' name for the same thing as
    ``outer_shard_mesh``; under DDP (replicated parameters, a ``ProcessGroup``) each rank computes
    the factors of its share of every megabatch and one all-gather returns the rest.
    """

    def __init__(
        self,
        params: Params,
        lr: float = 0.01,
        rank_fraction: float = 1.0,
        mu: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.01,
        epsilon: float = 1e-8,
        adjust_lr: str | None = "spectral_norm",
        qr_method: str = "cholesky_qr",
        flatten: bool = False,
        nonfinite: str = "raise",
        capturable: bool = False,
        replicate_mesh: Any = None,
        outer_shard_mesh: Any = None,
        inner_shard_mesh: Any = None,
        distributed_mesh: Any = None,
        replica_sync_every: int | None = 100,
    ) -> None:
        resolve_process_group(outer_shard_mesh, "outer_shard_mesh")  # a clear error for a wrong type
        if replica_sync_every is not None and (isinstance(replica_sync_every, bool) or
                                               not isinstance(replica_sync_every, int) or replica_sync_every < 1):
            raise ValueError(f"replica_sync_every={replica_sync_every!r} must be a positive number of steps, or None "
                             "(average the replicas' momenta only when a state dict is taken)")
        if distributed_mesh is not None:
            if outer_shard_mesh is not None:
                raise ValueError("pass either distributed_mesh (DDP: a ProcessGroup) or outer_shard_mesh (FSDP2), "
                                 "not both; for Dion they are the same mesh")
            outer_shard_mesh = distributed_mesh
        super().__init__(params, dict(
            algorithm="dion", lr=lr, rank_fraction=rank_fraction, mu=mu, betas=betas,
            weight_decay=weight_decay, epsilon=epsilon, adjust_lr=adjust_lr, qr_method=qr_method,
            flatten=flatten, nonfinite=nonfinite,
        ), distributed_mesh=outer_shard_mesh, replicate_mesh=replicate_mesh, inner_shard_mesh=inner_shard_mesh,
            capturable=capturable)
        self._replica_sync_every = replica_sync_every
