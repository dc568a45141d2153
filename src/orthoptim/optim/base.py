"""The optimizer shell shared by every orthoptim optimizer: groups, state and the step loop.

Each subclass only chooses defaults. Every group may pick any algorithm ("dion3", "dion2", "dion",
"muon", "normuon" for matrices, "adamw", "lion" for the rest); the math lives in ``orthoptim.rules``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from orthoptim import rules
from orthoptim.distributed import CommStats, megabatches, resolve_process_group, split_batch
from orthoptim.optim.matrix_view import MatrixView, matrix_view
from orthoptim.optim.validation import MATRIX_ALGORITHMS, validate_group
from orthoptim.orthogonalize import Orthogonalizer, get_orthogonalizer, normalize_columns

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = ()  # type: ignore[assignment,misc]

# Every key any algorithm reads, with its library-wide default; subclasses override some.
COMMON_DEFAULTS: dict[str, Any] = {
    "algorithm": "dion3",
    "lr": 0.01,
    "weight_decay": 0.01,
    "mu": 0.95,
    "fraction": 0.25,
    "rank_fraction": 1.0,
    "muon_beta2": 0.95,
    "betas": (0.9, 0.95),
    "epsilon": 1e-8,
    "nesterov": False,
    "adjust_lr": "spectral_norm",
    "orthogonalizer": None,  # None: the algorithm's own default (DEFAULT_ORTHOGONALIZER)
    "flatten": False,
    "num_heads": None,
    "split_sizes": None,
    "nonfinite": "raise",
    "selection_scope": "local",
    "qr_method": "cholesky_qr",
}
DEFAULT_ORTHOGONALIZER = {"dion3": "gram", "dion2": "polar_express", "muon": "polar_express",
                          "normuon": "polar_express"}
# Keys that are not hyperparameters but may legitimately sit in a group.
_BOOKKEEPING_KEYS = {"params", "param_names", "name", "initial_lr"}
# Seed of Dion's random initial right factors: fixed, so every rank and every run starts alike.
_DION_Q_SEED = 20250405


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf; raised before any parameter or state is changed."""


@dataclass
class _Matrix:
    """One matrix of one parameter, with the matching views of its gradient and state."""

    param: Tensor
    grad: Tensor
    momentum: Tensor
    extra: Tensor | None  # per-row variance [rows] (NorMuon, Dion3) or right factor [cols, r] (Dion)
    rank: int = 0


class OrthonormalOptimizer(Optimizer):
    """Base class: validates groups up front, creates state eagerly, megabatches same-shape matrices."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], distributed_mesh: Any = None) -> None:
        self._process_group = resolve_process_group(distributed_mesh)
        self.comm_stats: CommStats | None = None  # opt-in: set to a CommStats() to count collectives
        full = {**COMMON_DEFAULTS, **defaults}
        validate_group(full, "the optimizer's defaults")
        self._names: dict[Tensor, str] = {}
        self._positions: dict[Tensor, int] = {}  # order of first appearance: seeds Dion's Q
        super().__init__(params, full)

    # ----------------------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        index = len(self.param_groups)
        unknown = sorted(set(param_group) - set(self.defaults) - _BOOKKEEPING_KEYS)
        for key in unknown:
            warnings.warn(
                f"param group {index} has key {key!r}, which {type(self).__name__} does not read; "
                f"check its spelling (known keys: {sorted(self.defaults)})",
                stacklevel=3,
            )
        merged = {**self.defaults, **param_group}
        validate_group(merged, f"param group {index}")
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p if isinstance(p, tuple) else (None, p)) for p in raw]
        offset = sum(len(g["params"]) for g in self.param_groups)
        names = param_group.get("param_names") or [None] * len(named)
        for j, (name, p) in enumerate(named):
            label = name or names[j] or f"param_groups[{index}].params[{j}] (#{offset + j})"
            self._check_param(p, merged, label)
        param_group = {**param_group, "params": raw}
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for j, p in enumerate(group["params"]):
            given = group.get("param_names", [None] * len(group["params"]))[j]
            self._names.setdefault(p, given or f"param_groups[{index}].params[{j}] (#{offset + j})")
            self._positions.setdefault(p, offset + j)
            self._init_state(p, group)

    def _check_param(self, p: Tensor, group: dict[str, Any], label: str) -> None:
        if not isinstance(p, Tensor):
            return  # torch.optim reports the type error itself
        if group["algorithm"] in MATRIX_ALGORITHMS:
            self._view(p, group, label)
            if not p.is_contiguous():
                raise ValueError(f"parameter {label} is not contiguous; call .contiguous() on it first")
        if isinstance(p, DTensor):
            raise NotImplementedError(
                f"parameter {label} is a DTensor with placements {tuple(p.placements)}: sharded parameters "
                "(FSDP2, tensor parallel) are not supported in this version; use replicated parameters (DDP) "
                "with distributed_mesh=<ProcessGroup>"
            )

    def param_name(self, p: Tensor) -> str:
        """The parameter's name (from ``param_names``) or its position in the optimizer."""
        return self._names.get(p, "<unknown parameter>")

    def _view(self, p: Tensor, group: dict[str, Any], label: str | None = None) -> MatrixView:
        return matrix_view(
            p.shape,
            name=label or self.param_name(p),
            flatten=group["flatten"],
            num_heads=group["num_heads"],
            split_sizes=group["split_sizes"],
        )

    @staticmethod
    def _dion_ranks(view: MatrixView, rank_fraction: float) -> list[int]:
        return [max(1, math.ceil(rank_fraction * min(r, c) - 1e-9)) for r, c in view.block_shapes()]

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        """Create every state tensor the group's algorithm reads (idempotent, deterministic)."""
        state = self.state[p]
        algorithm = group["algorithm"]
        if algorithm == "adamw":
            state.setdefault("step", torch.tensor(0.0))
            state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
            state.setdefault("exp_avg_sq", torch.zeros_like(p, memory_format=torch.preserve_format))
            return
        if algorithm == "lion":
            state.setdefault("exp_avg", torch.zeros_like(p, memory_format=torch.preserve_format))
            return
        view = self._view(p, group)
        state.setdefault("momentum", torch.zeros_like(p, memory_format=torch.contiguous_format))
        if algorithm in ("normuon", "dion3"):
            # One second moment per row (neuron), kept in fp32: it is tiny and an EMA needs the bits.
            state.setdefault("variance", torch.zeros(view.batch, view.rows, device=p.device, dtype=torch.float32))
        if algorithm == "dion":
            ranks = self._dion_ranks(view, group["rank_fraction"])
            shape = (view.num_matrices, view.cols, max(ranks))
            if "Q" in state and tuple(state["Q"].shape) != shape:
                raise ValueError(
                    f"parameter {self.param_name(p)}: Dion right factor Q has shape {tuple(state['Q'].shape)} "
                    f"but rank_fraction={group['rank_fraction']} needs {shape}; keep rank_fraction fixed "
                    "during training or start from a fresh optimizer"
                )
            if "Q" not in state:
                gen = torch.Generator().manual_seed(_DION_Q_SEED + self._positions[p])
                q = normalize_columns(torch.randn(shape, generator=gen, dtype=torch.float32), group["epsilon"])
                state["Q"] = q.to(device=p.device, dtype=p.dtype)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for state in self.state.values():
            if "variance" in state:
                state["variance"] = state["variance"].float()

    # ----------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step. Checks every gradient first; on a non-finite gradient
        either raises (no parameter or state changed) or skips that parameter, per ``nonfinite``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        work = self._drop_nonfinite(work)
        for group, params in work:
            if not params:
                continue
            for p in params:
                self._init_state(p, group)
            if group["algorithm"] in MATRIX_ALGORITHMS:
                self._matrix_step(group, params)
            else:
                self._scalar_step(group, params)
        return loss

    def _drop_nonfinite(self, work: list[tuple[dict, list[Tensor]]]) -> list[tuple[dict, list[Tensor]]]:
        params = [p for _, ps in work for p in ps]
        for p in params:
            if p.grad.is_sparse:
                raise ValueError(f"parameter {self.param_name(p)} has a sparse gradient; orthoptim needs dense ones")
            if p.grad.shape != p.shape:
                raise ValueError(
                    f"parameter {self.param_name(p)} has shape {tuple(p.shape)} but its gradient has "
                    f"shape {tuple(p.grad.shape)}"
                )
        if not params:
            return work
        # One reduction pass over all gradients and one host sync for the whole step.
        maxima = torch._foreach_norm([p.grad for p in params], ord=math.inf)
        finite = torch.isfinite(torch.stack([m.float().to(maxima[0].device) for m in maxima]))
        if bool(finite.all()):
            return work
        bad = {p for p, ok in zip(params, finite.tolist()) if not ok}
        for group, ps in work:
            for p in ps:
                if p in bad and group["nonfinite"] == "raise":
                    raise NonFiniteGradientError(
                        f"parameter {self.param_name(p)} has a non-finite gradient (NaN or Inf); no "
                        "parameter or state was changed. Lower the learning rate, clip gradients, or pass "
                        "nonfinite='skip' to skip such updates"
                    )
        for p in bad:
            warnings.warn(
                f"parameter {self.param_name(p)} has a non-finite gradient; its update was skipped this step",
                stacklevel=3,
            )
        return [(g, [p for p in ps if p not in bad]) for g, ps in work]

    def _orthogonalizer(self, group: dict[str, Any]) -> Orthogonalizer:
        spec = group["orthogonalizer"] or DEFAULT_ORTHOGONALIZER[group["algorithm"]]
        return self._share(get_orthogonalizer(spec))

    def _share(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """Distributed: each rank computes its share of a batch function and all-gathers the rest."""
        if self._process_group is None:
            return fn
        return split_batch(fn, self._process_group, self.comm_stats)

    def _matrix_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        algorithm = group["algorithm"]
        matrices: list[_Matrix] = []
        for p in params:
            view = self._view(p, group)
            state = self.state[p]
            grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            extra: list[Any]
            ranks = [0] * view.num_matrices
            if algorithm in ("normuon", "dion3"):
                extra = view.row_vectors(state["variance"])
            elif algorithm == "dion":
                ranks = self._dion_ranks(view, group["rank_fraction"])
                extra = [state["Q"][i, :, :r] for i, r in enumerate(ranks)]
            else:
                extra = [None] * view.num_matrices
            for x, g, m, e, r in zip(view.matrices(p), view.matrices(grad), view.matrices(state["momentum"]),
                                     extra, ranks):
                matrices.append(_Matrix(x, g, m, e, r))

        lr, wd = group["lr"], group["weight_decay"]
        for batch in megabatches(matrices, key=lambda m: (tuple(m.param.shape), m.param.dtype,
                                                           m.param.device, m.rank)):
            xs = [m.param for m in batch]
            gs = [m.grad for m in batch]
            ms = [m.momentum for m in batch]
            es = [m.extra for m in batch]
            scale = rules.lr_scale(*xs[0].shape, group["adjust_lr"])
            common = {"lr": lr, "weight_decay_rate": wd, "scale": scale}
            if algorithm == "muon":
                rules.muon_update(xs, gs, ms, mu=group["mu"], nesterov=group["nesterov"],
                                  orthogonalize=self._orthogonalizer(group), **common)
            elif algorithm == "normuon":
                rules.normuon_update(xs, gs, ms, es, mu=group["mu"], nesterov=group["nesterov"],
                                     beta2=group["muon_beta2"], eps=group["epsilon"],
                                     orthogonalize=self._orthogonalizer(group), **common)
            elif algorithm == "dion2":
                rules.dion2_update(xs, gs, ms, fraction=group["fraction"], mu=group["mu"],
                                   orthogonalize=self._orthogonalizer(group), **common)
            elif algorithm == "dion3":
                rules.dion3_update(xs, gs, ms, es, fraction=group["fraction"], mu=group["mu"],
                                   beta2=group["muon_beta2"], eps=group["epsilon"],
                                   orthogonalize=self._orthogonalizer(group), **common)
            else:
                factors = self._share(partial(rules.low_rank_factors, qr_method=group["qr_method"]))
                rules.dion_update(xs, gs, ms, es, mu=group["mu"], eps=group["epsilon"], factors=factors, **common)

    def _scalar_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        key = (lambda p: (p.device, p.dtype, float(self.state[p]["step"]))) if group["algorithm"] == "adamw" \
            else (lambda p: (p.device, p.dtype))
        for batch in megabatches(params, key=key):
            grads = [p.grad for p in batch]
            states = [self.state[p] for p in batch]
            if group["algorithm"] == "adamw":
                for s in states:
                    s["step"] += 1
                rules.adamw_update(batch, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                                   int(states[0]["step"]), lr=group["lr"], beta1=beta1, beta2=beta2,
                                   eps=group["epsilon"], weight_decay_rate=group["weight_decay"])
            else:
                rules.lion_update(batch, grads, [s["exp_avg"] for s in states], lr=group["lr"], beta1=beta1,
                                  beta2=beta2, weight_decay_rate=group["weight_decay"])
