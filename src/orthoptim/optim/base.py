"""The optimizer shell shared by every orthoptim optimizer: groups, state and the step loop.

Each subclass only chooses defaults. Every group may pick any algorithm ("dion3", "dion2", "dion",
"muon", "normuon" for matrices, "adamw", "lion" for the rest); the math lives in ``orthoptim.rules``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial, reduce
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from orthoptim import rules
from orthoptim.distributed import CommStats, megabatches, resolve_process_group, split_batch
from orthoptim.distributed.column_exchange import ColumnShardedPlan
from orthoptim.distributed.factor_sharding import FactorSharding, factor_sharding
from orthoptim.distributed.gather import full_tensors
from orthoptim.distributed.low_rank import sharded_low_rank_factors
from orthoptim.distributed.row_exchange import GlobalRowSelection, RowExchange, shard_rows
from orthoptim.kernels import cpu_dtype
from orthoptim.optim.matrix_view import MatrixView, matrix_view
from orthoptim.optim.validation import MATRIX_ALGORITHMS, readers_of, unread_options, validate_group
from orthoptim.orthogonalize import (
    Orthogonalizer,
    PolarFactors,
    get_factored_orthogonalizer,
    get_orthogonalizer,
    input_dtype,
    normalize_columns,
)
from orthoptim.rules.normalization import orthogonalize_and_normalize
from orthoptim.rules.selection import num_selected

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = Replicate = Shard = ()  # type: ignore[assignment,misc]
    distribute_tensor = None
try:  # DTensor's own rule for a rank's block (private; _chunked_local_shape below where it is missing)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _dtensor_local_shape
except ImportError:
    _dtensor_local_shape = None

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
# Single process, a megabatch is orthogonalized in up to this many parts of at least this many
# elements (see OrthonormalOptimizer._memory_chunks): transient memory vs the size of batched calls.
MEMORY_CHUNKS = 4
CHUNK_MIN_ELEMENTS = 1 << 20
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
    rank: int
    layout: str  # see OrthonormalOptimizer._layout
    full_shape: tuple[int, int]  # the whole matrix's shape (differs from param.shape when row-sharded)
    sharding: FactorSharding | None = None  # Dion's split of a sharded matrix ("factor_sharded")
    name: str = ""  # the parameter's, for errors


def _chunked_local_shape(p: Tensor) -> tuple[int, ...]:
    """The shape of this rank's block of a DTensor under torch.chunk-style sharding, as DTensor and
    FSDP2 split it: each Shard(d) in mesh-dimension order splits what the earlier ones left."""
    if _dtensor_local_shape is not None:
        return tuple(_dtensor_local_shape(p.shape, p.device_mesh, p.placements)[0])
    shape = list(p.shape)
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            sizes = shard_rows(shape[placement.dim], p.device_mesh.size(mesh_dim))
            shape[placement.dim] = sizes[p.device_mesh.get_local_rank(mesh_dim)]
    return tuple(shape)


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a view: in-place updates land in the DTensor), or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _Gathered:
    """Whole copies of a sharded matrix's momentum, gradient and row variance for one step.

    The rule runs on these with a zero "parameter" that collects the update (its weight decay is
    applied on the shard directly); ``write_back`` keeps each rank's block. ``gather_all`` builds
    them for many parameters with one set of collectives per layout.
    """

    def __init__(self, p: Tensor, state: dict[str, Any], momentum: Tensor, grad: Tensor, variance: Tensor | None):
        self.p, self.state = p, state
        self.momentum, self.grad, self.variance = momentum, grad, variance
        self.delta = torch.zeros(p.shape, dtype=p.dtype, device=self.momentum.device)

    @classmethod
    def gather_all(cls, params: list[Tensor], states: list[dict[str, Any]],
                   stats: CommStats | None) -> list[_Gathered]:
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
        rules.weight_decay.decay_([local], lr, weight_decay)
        local.add_(self._block(self.delta, self.p))
        self.state["momentum"].to_local().copy_(self._block(self.momentum, self.p))
        if self.variance is not None:
            self.state["variance"].to_local().copy_(self._block(self.variance, self.state["variance"]))


class _RowShardedPlan:
    """The communication around one megabatch of row-sharded matrices: which rows each rank sends
    (all, per-shard top-k, or exact global top-k) and the two all-to-alls around the middle step."""

    def __init__(self, group: dist.ProcessGroup, rows: int, batch: int, stats: CommStats | None):
        self.group, self.rows, self.batch, self.stats = group, rows, batch, stats
        self.counts: Callable[[], list] = lambda: shard_rows(rows, dist.get_world_size(group))

    def select_rows(self, fraction: float, scope: str) -> Callable[[list[Tensor]], Any] | None:
        """Per-shard top-k needs no hook (the rule's own top-k on local rows); global selection does."""
        if scope == "global":
            selector = GlobalRowSelection(self.group, self.rows, num_selected(self.rows, fraction), self.stats)
            self.counts = lambda: selector.counts
            return selector
        per_shard = [num_selected(c, fraction) for c in shard_rows(self.rows, dist.get_world_size(self.group))]
        self.counts = lambda: per_shard
        return None

    def around(self, fn: Callable[..., Any]) -> Callable[..., tuple[Tensor, ...]]:
        """``fn`` run on whole rows at the owner ranks, called with and returning this rank's rows."""
        return lambda *local: RowExchange(self.group, self.counts(), self.batch, self.stats).run(fn, *local)


def _row_state_dtype(p: Tensor) -> torch.dtype:
    """The per-row variance is an EMA of small numbers: at least fp32, whatever the parameter's dtype."""
    return torch.promote_types(p.dtype, torch.float32)


def _users(spec: Any) -> bool:
    """Whether a group's orthogonalizer is a callable of the user's, not a name or this library's own
    function (e.g. ``svd_polar``, or a partial of one): only those have their outputs checked, since a
    check reads the output back on the host (it would stall a GPU step)."""
    if not callable(spec):
        return False
    while isinstance(spec, partial):
        spec = spec.func
    return getattr(spec, "__module__", "").split(".")[0] != "orthoptim"


def _capturing() -> bool:
    """Whether a CUDA graph is being captured now (never on a build or machine without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _first(fn: Callable[..., tuple[Tensor, ...]]) -> Callable[..., Tensor]:
    return lambda *args: fn(*args)[0]


class OrthonormalOptimizer(Optimizer):
    """Base class: validates groups up front, creates state eagerly, megabatches same-shape matrices."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], distributed_mesh: Any = None,
                 replicate_mesh: Any = None, inner_shard_mesh: Any = None, capturable: bool = False) -> None:
        if not isinstance(capturable, bool):
            raise ValueError(f"capturable={capturable!r} must be True or False")
        cpu_dtype.requested()  # a bad ORTHOPTIM_CPU_DTYPE is refused here, by name, not in the first step
        # Capturable: no host sync in step() (see orthoptim.optim.capture); set before groups are added.
        self.capturable = capturable
        self.nonfinite_found: Tensor | None = None  # capturable: a device flag of the last step
        self._orthogonalizer_problems: list[str] = []  # what a user's orthogonalizer did wrong this step
        self._verdict_index: dict[tuple, Tensor] = {}  # see _positions_among
        self._nonfinite_flags: tuple[list[Tensor], Tensor] | None = None
        self._process_group = resolve_process_group(distributed_mesh)
        # Data parallel without DDP (Dion's compressed sync): this optimizer averages the gradients.
        self._replicate_group = resolve_process_group(replicate_mesh, "replicate_mesh")
        # Dion's tensor-parallel mesh; its outer_shard_mesh is distributed_mesh.
        self._inner_group = resolve_process_group(inner_shard_mesh, "inner_shard_mesh")
        self.comm_stats: CommStats | None = None  # opt-in: set to a CommStats() to count collectives
        full = {**COMMON_DEFAULTS, **defaults}
        validate_group(full, "the optimizer's defaults")
        self._names: dict[Tensor, str] = {}
        self._positions: dict[Tensor, int] = {}  # order of first appearance: seeds Dion's Q
        # Read once per parameter (placements never change): Dion's split of a sharded matrix, and
        # whether a parameter is sharded over a mesh dimension none of the optimizer's meshes covers.
        self._factor_specs: dict[Tensor, FactorSharding] = {}
        self._beyond_meshes: dict[Tensor, bool] = {}
        self._over_distributed_mesh: dict[Tensor, bool] = {}  # its one sharded mesh dim is distributed_mesh
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
        for key in unread_options(param_group, merged["algorithm"], set(self.defaults)):
            warnings.warn(
                f"param group {index} sets {key}={param_group[key]!r}, which algorithm={merged['algorithm']!r} does "
                f"not read (it is read by {', '.join(readers_of(key))}); remove it, or set the algorithm it was "
                "meant for",
                stacklevel=3,
            )
        if self.capturable and merged["selection_scope"] == "global" and merged["algorithm"] in ("dion2", "dion3"):
            raise ValueError(
                f"param group {index}: selection_scope='global' sizes its row exchange from the selected rows "
                "on the host, which capturable=True rules out; use selection_scope='local' or capturable=False"
            )
        if self.capturable and merged["nonfinite"] == "skip":
            raise ValueError(
                f"param group {index}: nonfinite='skip' needs a host sync each step, which capturable=True "
                "rules out; keep nonfinite='raise' (with capturable=True, non-finite gradients are flagged and "
                "optimizer.check_nonfinite() raises after the step) or set capturable=False"
            )
        raw = param_group["params"]
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p if isinstance(p, tuple) else (None, p)) for p in raw]
        offset = sum(len(g["params"]) for g in self.param_groups)
        names = param_group.get("param_names") or [None] * len(named)
        if len(names) != len(named):
            raise ValueError(f"param group {index} has {len(named)} params but {len(names)} param_names; "
                             "give one name per parameter, in the same order")
        labels = [name or names[j] or f"param_groups[{index}].params[{j}] (#{offset + j})"
                  for j, (name, _) in enumerate(named)]
        self._check_blocks([p for _, p in named], labels, index)
        for (_, p), label in zip(named, labels):
            self._check_param(p, merged, label)
        super().add_param_group({**param_group, "params": raw})
        group = self.param_groups[-1]
        if self.capturable:
            self._lr_to_tensor(group, index)
        elif "lr" not in param_group and isinstance(group["lr"], Tensor):
            # An inherited tensor lr is copied: schedulers fill each group's lr in place, and groups
            # sharing one tensor would all take the last group's value.
            group["lr"] = group["lr"].detach().clone()
        for j, (p, label) in enumerate(zip(group["params"], labels)):
            self._names.setdefault(p, label)
            self._positions.setdefault(p, offset + j)
            self._init_state(p, group)

    @staticmethod
    def _lr_to_tensor(group: dict[str, Any], index: int) -> None:
        """A 0-dim fp32 tensor on the parameters' device: a captured graph reads it at replay, and
        LR schedulers fill it in place (assigning a new float would be ignored by the graph)."""
        devices = {p.device for p in group["params"]}
        if len(devices) > 1:
            raise ValueError(f"param group {index} holds parameters on {sorted(map(str, devices))}; with "
                             "capturable=True each group's parameters must be on one device")
        device = devices.pop() if devices else torch.device("cpu")
        lr = group["lr"]
        # A copy per group: groups that inherit one default must not share the tensor a scheduler fills.
        if isinstance(lr, Tensor):
            group["lr"] = lr.detach().to(device=device, dtype=torch.float32, copy=True).reshape(())
        else:
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)

    def _check_blocks(self, params: list[Any], labels: list[str], index: int) -> None:
        """Every sharded DTensor must hold torch.chunk's block (FSDP2's and distribute_tensor's split):
        the exchanges size every rank's block that way, so another block would fail or hang in the
        first step. Agreed on by every rank before any other check, over the groups the step's
        verdicts use (``_verdict_groups``): a rank whose own blocks match must raise too, not wait in a
        collective for the ranks that raised."""
        sharded = [(p, label) for p, label in zip(params, labels) if isinstance(p, DTensor) and
                   any(not isinstance(pl, Replicate) for pl in p.placements)]
        if not sharded:
            return
        problems = []
        for p, label in sharded:
            expected = _chunked_local_shape(p)
            if tuple(_local(p).shape) != tuple(expected):
                problems.append(f"parameter {label} (a DTensor with placements {tuple(p.placements)}) holds a "
                                f"block of shape {tuple(_local(p).shape)} of its {tuple(p.shape)} on this rank, but "
                                f"torch.chunk-style sharding gives {tuple(expected)}")
        flag = torch.tensor([len(problems)], dtype=torch.int32, device=_local(sharded[0][0]).device)
        for group in self._verdict_groups([p for p, _ in sharded]):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()):
            found = problems[0] if problems else (f"another rank holds a block of a parameter of param group {index} "
                                                  "that is not torch.chunk's (its error names it)")
            raise ValueError(f"{found}; only torch.chunk-style shards (FSDP2's, distribute_tensor's) are supported")

    def _check_param(self, p: Tensor, group: dict[str, Any], label: str) -> None:
        if not isinstance(p, Tensor):
            return  # torch.optim reports the type error itself
        if not p.is_floating_point():
            # Integer parameters have no gradient step; complex ones would need complex-aware norms
            # and orthogonalization, which no rule here has.
            hint = " (for complex weights, optimize torch.view_as_real of them)" if p.is_complex() else ""
            raise ValueError(f"parameter {label} has dtype {p.dtype}; orthoptim optimizes real floating-point "
                             f"parameters (float16, bfloat16, float32, float64){hint}")
        if group["algorithm"] in MATRIX_ALGORITHMS:
            self._view(p, group, label)
            if not p.is_contiguous():
                raise ValueError(f"parameter {label} is not contiguous; call .contiguous() on it first")
        if isinstance(p, DTensor):
            self._check_dtensor(p, group, label)

    def _check_dtensor(self, p: Tensor, group: dict[str, Any], label: str) -> None:
        """Sharded layouts this version runs exactly; anything else is an error, never a silent fallback."""
        where = f"parameter {label} (a DTensor with placements {tuple(p.placements)})"
        if self._layout(p, group) == "factor_sharded":
            if self._process_group is None and self._inner_group is None:
                raise ValueError(f"{where}: pass outer_shard_mesh=<its FSDP mesh> and/or "
                                 "inner_shard_mesh=<its tensor-parallel mesh> to Dion")
            self._factor_spec(p, label)
            return
        if self._process_group is None and (self._inner_group is None or group["algorithm"] in MATRIX_ALGORITHMS):
            raise ValueError(f"{where}: pass distributed_mesh=<the 1-D shard mesh or its ProcessGroup>")
        sharded = [i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
        if group["algorithm"] not in MATRIX_ALGORITHMS or len(sharded) != 1:
            return  # elementwise rules, replicated matrices and gathered (e.g. FSDP x TP) matrices
        layout = self._layout(p, group)
        if type(p.placements[sharded[0]]) is not Shard or p.placements[sharded[0]].dim != 0:
            return
        if p.device_mesh.size(sharded[0]) != dist.get_world_size(self._process_group):
            raise ValueError(
                f"{where}: its shard mesh dimension has {p.device_mesh.size(sharded[0])} ranks but "
                f"distributed_mesh has {dist.get_world_size(self._process_group)}; pass the mesh (for HSDP "
                "the shard sub-mesh, e.g. mesh['shard']) the parameter is sharded over")
        if layout == "row_sharded" and not self._sharded_over_distributed_mesh(p):
            # Same size, other ranks (e.g. HSDP's replicate sub-mesh): rows would be assembled from
            # replicas instead of shards.
            shard_ranks = dist.get_process_group_ranks(p.device_mesh.get_group(sharded[0]))
            raise ValueError(
                f"{where}: it is sharded over ranks {shard_ranks} but distributed_mesh holds ranks "
                f"{dist.get_process_group_ranks(self._process_group)}; pass the mesh the parameter is sharded "
                "over (for HSDP the shard sub-mesh, e.g. mesh['shard'])")

    def _dion_meshes(self) -> dict[str, dist.ProcessGroup | None]:
        return {"outer_shard_mesh": self._process_group, "inner_shard_mesh": self._inner_group}

    def _factor_spec(self, p: Tensor, label: str | None = None) -> FactorSharding:
        if p not in self._factor_specs:
            self._factor_specs[p] = factor_sharding(p, label or self.param_name(p), self._dion_meshes())
        return self._factor_specs[p]

    def param_name(self, p: Tensor) -> str:
        """The parameter's name (from ``param_names``) or its position in the optimizer."""
        return self._names.get(p, "<unknown parameter>")

    def _view(self, p: Tensor, group: dict[str, Any], label: str | None = None,
              shape: tuple[int, ...] | None = None) -> MatrixView:
        """The parameter's matrix layout under the group's options (``shape``: a local shard's instead)."""
        return matrix_view(
            p.shape if shape is None else shape,
            name=label or self.param_name(p),
            flatten=group["flatten"],
            num_heads=group["num_heads"],
            split_sizes=group["split_sizes"],
        )

    @staticmethod
    def _dion_ranks(view: MatrixView, rank_fraction: float) -> list[int]:
        return [max(1, math.ceil(rank_fraction * min(r, c) - 1e-9)) for r, c in view.block_shapes()]

    @classmethod
    def _dion_q_shape(cls, view: MatrixView, rank_fraction: float) -> tuple[int, int, int]:
        """Dion's right factors, one [cols, r] per matrix, padded to the largest rank (1 for no matrices)."""
        return view.num_matrices, view.cols, max(cls._dion_ranks(view, rank_fraction), default=1)

    def _init_state(self, p: Tensor, group: dict[str, Any]) -> None:
        """Create every state tensor the group's algorithm reads (idempotent, deterministic).

        Called for each parameter every step, so it allocates only what is missing.
        """
        state = self.state[p]
        algorithm = group["algorithm"]
        needed: dict[str, Callable[[], Tensor]] = {}
        if algorithm == "adamw":
            # Capturable: the step count lives on the device, so the bias correction is read there.
            step_device = _local(p).device if self.capturable else "cpu"
            needed = {"step": lambda: torch.tensor(0.0, device=step_device), "exp_avg": lambda: torch.zeros_like(p),
                      "exp_avg_sq": lambda: torch.zeros_like(p)}
        elif algorithm == "lion":
            needed = {"exp_avg": lambda: torch.zeros_like(p)}
        else:
            needed = {"momentum": lambda: torch.zeros_like(p, memory_format=torch.contiguous_format)}
            if algorithm in ("normuon", "dion3"):
                # One second moment per row (neuron), in at least fp32: it is tiny and an EMA needs the bits.
                needed["variance"] = lambda: self._row_state(p, group)
        for key, make in needed.items():
            if key not in state:
                state[key] = make()
        if algorithm == "dion":
            view = self._view(p, group)
            shape = self._dion_q_shape(view, group["rank_fraction"])
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

    def _row_state(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Zeros [batch, rows] in fp32 (fp64 for fp64 parameters); for a DTensor parameter a DTensor,
        sharded like its rows where the step works on row shards, else replicated (it is small)."""
        dtype = _row_state_dtype(p)
        view = self._view(p, group)
        if not isinstance(p, DTensor):
            return torch.zeros(view.batch, view.rows, device=p.device, dtype=dtype)
        if self._layout(p, group) not in ("row_sharded", "local"):
            return DTensor.from_local(torch.zeros(view.batch, view.rows, device=_local(p).device, dtype=dtype),
                                      p.device_mesh, [Replicate()] * p.device_mesh.ndim)
        local = _local(p)
        # Shard(0) splits the rows of a matrix (dim 1 of [1, rows]) or the batch of a 3-D tensor (dim 0).
        batched = p.ndim == 3 and (view.batch, view.rows) == tuple(p.shape[:2])
        shape_local = (local.shape[0], view.rows) if batched else (1, local.shape[0])
        placements = tuple(pl if isinstance(pl, Replicate) else Shard(0 if batched else 1) for pl in p.placements)
        return DTensor.from_local(torch.zeros(shape_local, device=local.device, dtype=dtype),
                                  p.device_mesh, placements, shape=torch.Size((view.batch, view.rows)),
                                  stride=(view.rows, 1))

    def _expected_state_shapes(self, p: Tensor, group: dict[str, Any]) -> dict[str, tuple[int, ...]]:
        """The shape of every state tensor ``_init_state`` would create for ``p`` under ``group``."""
        algorithm, shape = group["algorithm"], tuple(p.shape)
        if algorithm == "adamw":
            return {"step": (), "exp_avg": shape, "exp_avg_sq": shape}
        if algorithm == "lion":
            return {"exp_avg": shape}
        view = self._view(p, group)
        expected = {"momentum": shape}
        if algorithm in ("normuon", "dion3"):
            expected["variance"] = (view.batch, view.rows)
        if algorithm == "dion":
            expected["Q"] = self._dion_q_shape(view, group["rank_fraction"])
        return expected

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Refuse a state dict that would make a later step fail or silently use state of another shape:
        checked before anything is loaded, so a refused one leaves this optimizer as it was."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups) or any(
                len(g.get("params", ())) != len(mine["params"]) for g, mine in zip(saved_groups, self.param_groups)):
            return  # torch.optim's own checks name these mismatches
        saved_state = state_dict.get("state", {})
        for index, (saved, mine) in enumerate(zip(saved_groups, self.param_groups)):
            where = f"param group {index} of the loaded state dict"
            if "algorithm" not in saved:
                raise ValueError(f"{where} has no 'algorithm' key, so it was not saved by an orthoptim optimizer; "
                                 f"load a state dict saved by {type(self).__name__}.state_dict()")
            merged = {**mine, **{k: v for k, v in saved.items() if k != "params"}}
            validate_group(merged, where)
            for i, p in zip(saved["params"], mine["params"]):
                label = self.param_name(p)
                self._check_param(p, merged, label)
                state = saved_state.get(i, {})
                for key, shape in self._expected_state_shapes(p, merged).items():
                    value = state.get(key)
                    if isinstance(value, Tensor) and tuple(value.shape) != shape and not (key == "step" and
                                                                                          value.numel() == 1):
                        raise ValueError(
                            f"parameter {label}: the loaded state {key!r} has shape {tuple(value.shape)} but "
                            f"{merged['algorithm']} needs {shape} for this parameter of shape {tuple(p.shape)}; "
                            "the state dict was saved for other parameters (or other group options) than "
                            "this optimizer's, in this order")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_loadable(state_dict)
        # torch.optim casts every floating state tensor to the parameter's dtype; the per-row variance
        # is at least fp32 by design, so it is taken from the saved copy rather than the rounded one.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = state_dict["state"]
        before = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, old in zip(self.param_groups, before):
            for key, value in old.items():  # keys a state dict of an older version lacks keep their values
                group.setdefault(key, value)
        for i, p in zip(ids, params):
            variance = saved.get(i, {}).get("variance")
            if variance is not None:
                self.state[p]["variance"] = variance.to(device=p.device, dtype=_row_state_dtype(p), copy=True)
            if self.capturable and "step" in self.state[p]:  # read on the device by a capturable step
                self.state[p]["step"] = self.state[p]["step"].to(device=_local(p).device, dtype=torch.float32)
        if self.capturable:
            for index, group in enumerate(self.param_groups):
                self._lr_to_tensor(group, index)

    # ----------------------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step. Checks every group's options and every gradient first; on a
        bad option it raises, on a non-finite gradient it raises or skips that parameter, per
        ``nonfinite``; either way before any parameter or state has changed."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            # Options may change between steps (LR schedules, a fraction schedule, a hand edit): a NaN
            # lr or a fraction above 1 is refused here rather than half-way through the step. A tensor
            # lr is not read (that would sync with its device); it was checked when it was set.
            options = {**group, "lr": 0.0} if isinstance(group["lr"], Tensor) else group
            validate_group(options, f"param group {index} (at step time)")
        work = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
        work = self._flag_nonfinite(work) if self.capturable else self._drop_nonfinite(work)
        if self._replicate_group is not None:
            self._average_gradients(work)
        for group, params in work:
            if not params:
                continue
            for p in params:
                self._init_state(p, group)
            if group["algorithm"] in MATRIX_ALGORITHMS:
                self._matrix_step(group, params)
            else:
                self._scalar_step(group, params)
        if any(_users(g["orthogonalizer"]) for g in self.param_groups):
            self._raise_orthogonalizer_problems()
        return loss

    def _average_gradients(self, work: list[tuple[dict, list[Tensor]]]) -> None:
        """Average over ``replicate_mesh`` every gradient that Dion's low-rank sync does not cover,
        one all-reduce per dtype (the Dion matrices exchange only P and R, in their rule)."""
        grads = [_local(p.grad) for group, ps in work if group["algorithm"] != "dion" for p in ps]
        world = dist.get_world_size(self._replicate_group)
        for batch in megabatches(grads, key=lambda g: (g.dtype, g.device)):
            flat = torch.cat([g.reshape(-1) for g in batch])
            # fp16 is divided first: the sum of finite fp16 gradients can overflow (65504), their mean not.
            narrow = flat.dtype == torch.float16
            if narrow:
                flat /= world
            dist.all_reduce(flat, group=self._replicate_group)
            if self.comm_stats is not None:
                self.comm_stats.record("all_reduce", flat.numel() * flat.element_size())
            if not narrow:
                flat /= world
            torch._foreach_copy_(batch, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in batch]), batch)])

    def _finite(self, params: list[Tensor], groups: list[dict[str, Any]], everyone: list[Tensor],
                verdict_groups: list[dist.ProcessGroup]) -> tuple[Tensor, Tensor, Tensor | None]:
        """Two bools per parameter (``groups[i]`` is the group of ``params[i]``), on the device, agreed
        on by every rank: is its gradient finite, and does this step's momentum fit its dtype (see
        ``_momentum_fits``)? Distributed, also one bool per parameter of the optimizer: does it have a
        gradient on some ranks and none on others (else None). ``everyone``, ``verdict_groups``: see
        ``_verdict_scope``."""
        for p in params:
            if p.grad.is_sparse:
                raise ValueError(f"parameter {self.param_name(p)} has a sparse gradient; orthoptim needs dense ones")
            if p.grad.shape != p.shape:
                raise ValueError(
                    f"parameter {self.param_name(p)} has shape {tuple(p.shape)} but its gradient has "
                    f"shape {tuple(p.grad.shape)}"
                )
        # One reduction pass over all gradients, and (eager steps) one host read of the verdict.
        grads = [_local(p.grad) for p in params]
        # A rank whose parameters have no gradients this step still takes part in the verdict.
        device = grads[0].device if grads else _local(everyone[0]).device

        def extremes_finite(gs: list[Tensor]) -> Tensor:
            # min and max are finite iff every entry is (NaN propagates), compared in the widest of the
            # gradients' dtypes (a finite fp64 1e300 stays finite); ~10x cheaper than an inf-norm on CPU,
            # and unlike a 2-norm it cannot overflow. Empty shards have nothing to check (zeros).
            wide = reduce(torch.promote_types, (g.dtype for g in gs), torch.float32)
            extremes = torch.stack([torch.stack(torch.aminmax(g)).to(device, wide) if g.numel()
                                    else torch.zeros(2, device=device, dtype=wide) for g in gs])
            return torch.isfinite(extremes).all(-1)

        summable = all(g.device.type == "cpu" and g.dtype.is_floating_point for g in grads)
        if not grads:
            finite = torch.ones(0, dtype=torch.bool, device=device)
        elif self.capturable or not summable:
            finite = extremes_finite(grads)
        else:
            # On CPUs a plain sum is ~1.7x faster than aminmax. A finite sum proves every entry finite
            # (an inf or NaN never sums to a finite number); a non-finite one may be an overflow of
            # large finite entries, so those gradients are checked again exactly (rarely: a host read).
            finite = torch.isfinite(torch.stack([g.sum(dtype=torch.float32) for g in grads]))
            if not bool(finite.all()):
                suspects = (~finite).nonzero().flatten().tolist()
                finite[suspects] = extremes_finite([grads[i] for i in suspects])
        fits = self._momentum_fits(params, groups, device)
        if not verdict_groups:
            return finite, fits, None
        # Sharded or unsynchronized gradients differ per rank: agree on the verdict, or ranks would
        # diverge (and hang in the next collective). The table covers every parameter of the
        # optimizer, so that it has one size on every rank even if the ranks disagree on which
        # parameters have a gradient: rows are bad gradient, bad momentum, has a gradient, has none.
        index = self._positions_among(params, everyone, device)
        # index_copy_/index_fill_ rather than item assignment: a Python value assigned through an index
        # becomes a fresh host tensor, a copy a CUDA graph cannot hold.
        table = torch.zeros(4, len(everyone), dtype=torch.uint8, device=device)
        table[0].index_copy_(0, index, (~finite).to(torch.uint8))
        table[1].index_copy_(0, index, (~fits).to(torch.uint8))
        table[2].index_fill_(0, index, 1)
        table[3].fill_(1).index_fill_(0, index, 0)
        for group in verdict_groups:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
            if self.comm_stats is not None:
                self.comm_stats.record("all_reduce", table.numel() * table.element_size())
        return table[0, index] == 0, table[1, index] == 0, (table[2] & table[3]).bool()

    def _positions_among(self, params: list[Tensor], everyone: list[Tensor], device: torch.device) -> Tensor:
        """Where ``params`` sit in ``everyone``, as a device index: built once per set of parameters
        (by identity), so a capturable step makes no host-to-device copy."""
        # Keyed by both sequences of identities: the index depends on nothing else, and entries stay
        # (a captured graph may read one after an eager step with other parameters).
        key = (tuple(map(id, everyone)), tuple(map(id, params)))
        if key not in self._verdict_index:
            position = {id(p): i for i, p in enumerate(everyone)}
            self._verdict_index[key] = torch.tensor([position[id(p)] for p in params], dtype=torch.long,
                                                    device=device)
        return self._verdict_index[key]

    def _raise_if_mixed(self, mixed: Tensor) -> None:
        names = [self.param_name(p) for p, m in zip(self._all_params(), mixed.tolist()) if m]
        raise ValueError(
            f"parameters {names} have a gradient on some ranks and none on others; every rank must give the "
            "same parameters gradients (set unused ones to zeros, e.g. p.grad = torch.zeros_like(p), or use "
            "the same model code on every rank). Nothing was changed")

    def _momentum_fits(self, params: list[Tensor], groups: list[dict[str, Any]], device: torch.device) -> Tensor:
        """False where an fp16 matrix's momentum (or, for Dion, its products with B = M + G) would
        overflow fp16 this step although the gradient is finite: the step would turn its weights
        into NaN. fp16 tops out at 65504; bf16 and wider hold fp32's range, and are always True.
        For such a matrix: one fp16 temporary of the new momentum (fp16 arithmetic overflows to
        inf exactly where the step's would), a max or row/column norms over it, nothing for other dtypes."""
        fits = torch.ones(len(params), dtype=torch.bool, device=device)
        for i, (p, group) in enumerate(zip(params, groups)):
            if p.dtype != torch.float16 or group["algorithm"] not in MATRIX_ALGORITHMS:
                continue
            momentum = self.state.get(p, {}).get("momentum")
            if momentum is None or not _local(momentum).numel():
                continue
            m, g = _local(momentum), _local(p.grad)
            top = torch.finfo(torch.float16).max
            if group["algorithm"] == "dion":
                # B Q and Bᵀ P: with unit-norm columns of Q and orthonormal ones of P, each entry is at
                # most a row's or a column's 2-norm of B = M + G, taken on the matrices Dion works on.
                # A shard holds part of each column (row) when the rows (columns) are sharded: its norm
                # times √(number of such shards) bounds the whole one.
                local = self._layout(p, group) == "local"  # whole matrices of a sharded batch
                batched = p.ndim == 3 and not group["flatten"]
                b = torch.add(m, g)
                if local or m.shape == p.shape:  # whole matrices, cut into the blocks Dion works on
                    view = self._view(p, group, shape=tuple(m.shape) if local else None)
                    b, blocks, (row_shards, col_shards) = b.view(view.batch, view.rows, view.cols), view.blocks, (1, 1)
                else:  # this rank's block of sharded matrices
                    b = b if batched else b.reshape(1, m.shape[0], -1)
                    blocks, (row_shards, col_shards) = ((0, b.shape[1]),), self._shard_counts(p, batched)
                cols = max(torch.linalg.vector_norm(b[:, start:start + n], dim=-2, dtype=torch.float32).amax()
                           for start, n in blocks) * math.sqrt(row_shards)
                rows = torch.linalg.vector_norm(b, dim=-1, dtype=torch.float32).amax() * math.sqrt(col_shards)
                size = torch.maximum(rows, cols)
            else:
                # As the rule computes it, in fp16, so inf exactly where it overflows: M ← G + μM (one
                # op, ``momentum.accumulate_and_stack``), and with Nesterov B = G + μM, also in fp16
                # (fp16 momenta are stacked in fp16: ``_stack_dtype``).
                mu = 1.0 if group["algorithm"] in ("dion2", "dion3") else group["mu"]
                nesterov = group["algorithm"] in ("muon", "normuon") and group["nesterov"]
                new = torch.add(g, m, alpha=mu)
                size = new.abs().amax()
                if nesterov:
                    size = torch.maximum(size, torch.add(g, new, alpha=mu).abs().amax())
            fits[i] = size.to(device=device, dtype=torch.float32) <= top
        return fits

    @staticmethod
    def _shard_counts(p: Tensor, batched: bool) -> tuple[int, int]:
        """How many shards split the rows and the columns of a parameter's matrices (``batched``: a
        [batch, rows, cols] tensor, whose dim 0 splits whole matrices)."""
        rows = cols = 1
        first = 1 if batched else 0
        for mesh_dim, placement in enumerate(getattr(p, "placements", ())):
            if isinstance(placement, Shard) and placement.dim >= first:
                if placement.dim == first:
                    rows *= p.device_mesh.size(mesh_dim)
                else:
                    cols *= p.device_mesh.size(mesh_dim)
        return rows, cols

    def _flag_nonfinite(self, work: list[tuple[dict, list[Tensor]]]) -> list[tuple[dict, list[Tensor]]]:
        """Capturable: record which gradients are non-finite without reading the verdict back."""
        params = [p for _, ps in work for p in ps]
        # A rank without gradients still joins the verdict's all-reduce.
        everyone, verdict_groups = self._verdict_scope()
        if params or verdict_groups:
            finite, fits, mixed = self._finite(params, [g for g, ps in work for _ in ps], everyone, verdict_groups)
            # Ranks that disagree on which parameters have gradients would hang in the next collective:
            # checked with a host read, except while a CUDA graph is being captured (the eager warm-up
            # steps before a capture have checked the same set of parameters).
            if mixed is not None and not _capturing() and bool(mixed.any()):
                self._raise_if_mixed(mixed)
            bad = ~(finite & fits)
            held = self._nonfinite_flags
            # Compared by identity: == on lists of tensors would compare their values elementwise.
            if held is not None and len(held[0]) == len(params) and all(a is b for a, b in zip(held[0], params)):
                # The same buffers every step: a captured graph writes the ones check_nonfinite reads,
                # also when eager steps run in between.
                held[1].copy_(bad)
                self.nonfinite_found.copy_(bad.any())
            else:
                self._nonfinite_flags = (params, bad)
                self.nonfinite_found = bad.any()
        return work

    def check_nonfinite(self) -> None:
        """Capturable optimizers: raise if the last step saw a non-finite gradient (reads one flag
        from the device; call it outside the captured step, e.g. every few steps)."""
        if self._nonfinite_flags is None:
            return
        params, bad = self._nonfinite_flags
        if bool(bad.any()):
            names = [self.param_name(p) for p, b in zip(params, bad.tolist()) if b]
            raise NonFiniteGradientError(
                f"parameters {names} had non-finite gradients (NaN or Inf), or float16 momenta that overflowed, "
                "in the last captured step; their "
                "update was applied, so restore the last checkpoint, then lower the learning rate or clip gradients"
            )

    def _drop_nonfinite(self, work: list[tuple[dict, list[Tensor]]]) -> list[tuple[dict, list[Tensor]]]:
        params = [p for _, ps in work for p in ps]
        everyone, verdict_groups = self._verdict_scope()
        if not params and not verdict_groups:
            return work
        finite, fits, mixed = self._finite(params, [g for g, ps in work for _ in ps], everyone, verdict_groups)
        ok = finite & fits
        # One host read of the whole verdict.
        all_ok, any_mixed = torch.stack([ok.all(), mixed.any() if mixed is not None else ok.new_zeros(())]).tolist()
        if any_mixed:
            self._raise_if_mixed(mixed)
        if all_ok:
            return work
        reasons = {  # gradient finite? → (what is wrong, how to fix it)
            False: ("a non-finite gradient (NaN or Inf)", "Lower the learning rate, clip gradients"),
            True: ("a finite gradient, but this step's momentum would overflow float16 (above 65504) and turn "
                   "the weights into NaN", "Keep such parameters in bfloat16 or float32, scale the loss or "
                   "gradients down"),
        }
        bad = {p: reasons[grad_ok] for p, grad_ok, step_ok in zip(params, finite.tolist(), ok.tolist()) if not step_ok}
        for group, ps in work:
            for p in ps:
                if p in bad and group["nonfinite"] == "raise":
                    why, fix = bad[p]
                    what = f"parameter {self.param_name(p)} has {why}; no parameter or state was changed"
                    error = NonFiniteGradientError(f"{what}. {fix}, or pass nonfinite='skip' to skip such updates")
                    error.what = what  # without the advice, for callers that give their own (the CLI)
                    raise error
        for p, (why, _) in bad.items():
            warnings.warn(
                f"parameter {self.param_name(p)} has {why}; its update was skipped this step",
                stacklevel=3,
            )
        return [(g, [p for p in ps if p not in bad]) for g, ps in work]

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _verdict_scope(self) -> tuple[list[Tensor], list[dist.ProcessGroup]]:
        """Every parameter of the optimizer, and the groups its step's verdicts are agreed over."""
        everyone = self._all_params()
        return everyone, self._verdict_groups(everyone) if everyone else []

    def _verdict_groups(self, params: list[Tensor]) -> list[dist.ProcessGroup]:
        """Every group over which gradients may differ: the optimizer's meshes, in a fixed order, and
        the whole world when a parameter is also sharded over a mesh dimension none of them covers
        (e.g. tensor parallelism next to FSDP's distributed_mesh). One world-wide reduction rather than
        one per such dimension keeps the sequence of collectives the same on every rank."""
        groups = [g for g in (self._process_group, self._replicate_group, self._inner_group) if g is not None]
        if any(self._sharded_beyond_meshes(p, groups) for p in params if isinstance(p, DTensor)):
            return [*groups, dist.group.WORLD]
        return groups

    def _sharded_beyond_meshes(self, p: Tensor, groups: list[dist.ProcessGroup]) -> bool:
        if p not in self._beyond_meshes:
            covered = {tuple(dist.get_process_group_ranks(g)) for g in groups}
            self._beyond_meshes[p] = any(
                tuple(dist.get_process_group_ranks(p.device_mesh.get_group(dim))) not in covered
                for dim, placement in enumerate(p.placements) if not isinstance(placement, Replicate))
        return self._beyond_meshes[p]

    def _stack_dtype(self, group: dict[str, Any], layout: str, momentum: Tensor) -> torch.dtype | None:
        """The dtype Muon stacks its batch in (None: the momentum's). Single process with a named
        iteration (its factored form runs): the dtype that iteration rounds its input to anyway. Not for
        fp16 momenta: G + μM is computed in the inputs' dtype, and fp16's could overflow on the way
        (``_momentum_fits`` then checks it)."""
        if group["algorithm"] != "muon" or layout != "replicated" or self._process_group is not None or \
                momentum.dtype == torch.float16:
            return None
        return input_dtype(group["orthogonalizer"] or DEFAULT_ORTHOGONALIZER["muon"], momentum)  # None: a callable

    @staticmethod
    def _orthogonalizer(group: dict[str, Any]) -> Orthogonalizer:
        return get_orthogonalizer(group["orthogonalizer"] or DEFAULT_ORTHOGONALIZER[group["algorithm"]])

    def _checked(self, fn: Orthogonalizer, names: list[str]) -> Orthogonalizer:
        """A user's orthogonalizer, its output checked: a wrong shape would broadcast into the update and
        NaNs would reach the parameters, both silently. A failing batch gets a zero update and the step
        ends with an error (``_raise_orthogonalizer_problems``). (Non-finite output is checked with a
        host read, so not in capturable steps.)"""
        def problem(u: Tensor, out: Any) -> str | None:
            if not isinstance(out, Tensor) or out.shape != u.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                return f"returned {got} for a batch of shape {tuple(u.shape)}; it must return the same shape"
            if not self.capturable and not bool(torch.isfinite(out).all()):
                return "returned non-finite values (NaN or Inf) for a finite batch" if bool(
                    torch.isfinite(u).all()) else "was given a non-finite batch (the momentum holds NaN or Inf)"
            return None

        return lambda u: self._call_checked(fn, u, names, problem, lambda: torch.zeros_like(u))

    def _checked_factors(self, fn: Callable[[Tensor], PolarFactors], names: list[str]) -> Callable[..., PolarFactors]:
        """A user's factored orthogonalizer (its ``factored`` attribute), checked as ``_checked`` checks
        products: [B, k, k] and [B, k, n] factors of the short side, finite; else zero factors."""
        def shapes(u: Tensor) -> tuple[tuple[int, int, int], tuple[int, int, int], bool]:
            b, rows, cols = u.shape
            k, n = min(rows, cols), max(rows, cols)
            return (b, k, k), (b, k, n), rows > cols

        def problem(u: Tensor, out: Any) -> str | None:
            left, right, transposed = shapes(u)
            if not isinstance(out, PolarFactors) or tuple(out.left.shape) != left or \
                    tuple(out.right.shape) != right or out.transposed != transposed:
                return (f"returned {out!r:.200} for a batch of shape {tuple(u.shape)}; it must return "
                        f"PolarFactors({list(left)}, {list(right)}, transposed={transposed})")
            if not self.capturable and not bool(torch.isfinite(out.left).all() & torch.isfinite(out.right).all()):
                return "returned non-finite factors (NaN or Inf)"
            return None

        def zero(u: Tensor) -> PolarFactors:
            left, right, transposed = shapes(u)
            return PolarFactors(u.new_zeros(left), u.new_zeros(right), transposed)

        return lambda u: self._call_checked(fn, u, names, problem, lambda: zero(u))

    def _call_checked(self, fn: Callable[[Tensor], Any], u: Tensor, names: list[str],
                      problem: Callable[[Tensor, Any], str | None], zero: Callable[[], Any]) -> Any:
        """``fn(u)``, or ``zero()`` when it raises or ``problem(u, out)`` finds something wrong. Not raised
        here: distributed, this may run on one rank only (an owner of whole rows, a share of a batch)
        while the others wait in a collective. A zero update stands in, the step completes on every
        rank, and step() raises on all of them together."""
        try:
            out = fn(u)
        except Exception as e:  # any failure of a user's function: reported after the step, on every rank
            self._report(fn, f"raised {type(e).__name__}: {e}", names)
            return zero()
        found = problem(u, out)
        if found is None:
            return out
        self._report(fn, found, names)
        return zero()

    def _report(self, fn: Callable[..., Any], problem: str, names: list[str]) -> None:
        self._orthogonalizer_problems.append(f"orthogonalizer {fn!r} {problem} (parameters {names})")

    def _raise_orthogonalizer_problems(self) -> None:
        """After a step with a user's orthogonalizer: raise on every rank if it failed on any."""
        problems, self._orthogonalizer_problems = self._orthogonalizer_problems, []
        failed = bool(problems)
        # While a CUDA graph is captured nothing is read back: only this rank's problems (wrong shapes,
        # seen on the host) are raised then; the eager steps before a capture agree across ranks.
        everyone, verdict_groups = self._verdict_scope() if not _capturing() else ([], [])
        if verdict_groups:
            flag = torch.zeros(1, dtype=torch.uint8, device=_local(everyone[0]).device).fill_(int(failed))
            for group in verdict_groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            failed = bool(flag.item())
        if failed:
            what = "; ".join(problems) if problems else "the orthogonalizer failed on another rank (see its error)"
            raise ValueError(
                f"{what}. Those matrices got a zero update this step (nothing non-finite reached the weights), "
                "but momenta and the other parameters were updated: fix the orthogonalizer, then restore the "
                "optimizer and model from a checkpoint")

    def _share(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """Distributed: each rank computes its share of a batch function and all-gathers the rest."""
        if self._process_group is None:
            return fn
        return split_batch(fn, self._process_group, self.comm_stats)

    def _layout(self, p: Tensor, group: dict[str, Any]) -> str:
        """How the step treats a parameter:

        - "replicated": whole on every rank (or a single process); DDP shares the batch of work;
        - "row_sharded": FSDP2 ``Shard(0)`` of a matrix over ``distributed_mesh`` (possibly replicated
          over other mesh dims, HSDP): rows are assembled at an owner rank and sent back;
        - "local": ``Shard(0)`` of a batch of matrices: each rank owns whole matrices, no communication;
        - "factor_sharded": Dion's matrices sharded along rows and/or columns (FSDP, TP, both):
          the blocks stay where they are and only low-rank factors are all-reduced;
        - "column_sharded": Dion3 matrices (and Dion2 ones that select rows) with ``Shard(1)`` over
          ``distributed_mesh`` (tensor parallelism): rows are selected from all-reduced norms and only
          the selected rows' column blocks travel, to an owner rank per matrix and back
          (distributed/column_exchange.py);
        - "gathered": any other sharding (``Shard(1)``, FSDP x TP, heads/splits on row shards): the
          momentum and gradient are all-gathered, the rule runs on whole matrices with the work
          shared over ``distributed_mesh``, and each rank keeps its block of the result.
        """
        if not isinstance(p, DTensor):
            return "replicated"
        sharded = [pl for pl in p.placements if not isinstance(pl, Replicate)]
        if not sharded:
            return "replicated"
        if group["algorithm"] == "dion" and (p.ndim == 2 or group["flatten"]) and \
                group["num_heads"] is None and group["split_sizes"] is None:
            return "factor_sharded"
        plain = group["num_heads"] is None and group["split_sizes"] is None
        if len(sharded) == 1 and type(sharded[0]) is Shard and sharded[0].dim == 0:
            if p.ndim == 3 and not group["flatten"]:
                return "local"
            if plain:
                return "row_sharded"
        # Dion3 selects rows; Dion2 too where rows are the shorter side (a tall one picks columns).
        selects_rows = group["algorithm"] == "dion3" or (group["algorithm"] == "dion2" and p.shape[0] <= p.shape[1])
        if len(sharded) == 1 and type(sharded[0]) is Shard and sharded[0].dim == 1 and p.ndim == 2 and plain \
                and selects_rows and self._sharded_over_distributed_mesh(p):
            return "column_sharded"
        return "gathered"

    def _sharded_over_distributed_mesh(self, p: Tensor) -> bool:
        if p not in self._over_distributed_mesh:
            dim = next(i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate))
            self._over_distributed_mesh[p] = self._process_group is not None and \
                dist.get_process_group_ranks(p.device_mesh.get_group(dim)) == \
                dist.get_process_group_ranks(self._process_group)
        return self._over_distributed_mesh[p]

    def _matrix_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        algorithm = group["algorithm"]
        matrices: list[_Matrix] = []
        layouts = [self._layout(p, group) for p in params]
        to_gather = [p for p, layout in zip(params, layouts) if layout == "gathered"]
        gathered = _Gathered.gather_all(to_gather, [self.state[p] for p in to_gather], self.comm_stats)
        whole_of = dict(zip(to_gather, gathered))
        for p, layout in zip(params, layouts):
            state = self.state[p]
            if layout == "gathered":
                whole = whole_of[p]
                x, m, grad = whole.delta, whole.momentum, whole.grad
            else:
                x, m = _local(p), _local(state["momentum"])
                grad = _local(p.grad)
                grad = grad if grad.is_contiguous() else grad.contiguous()
            if layout == "factor_sharded":
                spec = self._factor_spec(p)
                rank = self._dion_ranks(self._view(p, group), group["rank_fraction"])[0]
                shape = (spec.local_rows, spec.local_cols)
                matrices.append(_Matrix(x.view(shape), grad.view(shape), m.view(shape), state["Q"][0, :, :rank], rank,
                                        layout, (p.shape[0], math.prod(p.shape[1:])), spec, self.param_name(p)))
                continue
            if layout == "row_sharded":
                # One local row block of the full matrix; blocks (heads, splits) are rejected up front.
                full_rows, cols = p.shape[0], math.prod(p.shape[1:])
                expected = shard_rows(full_rows, dist.get_world_size(self._process_group))
                if x.shape[0] != expected[dist.get_rank(self._process_group)]:
                    raise ValueError(
                        f"parameter {self.param_name(p)}: local shard has {x.shape[0]} rows but Shard(0) of "
                        f"{full_rows} rows gives {expected}; only torch.chunk-style (FSDP2) sharding is supported"
                    )
                extra, rank = None, 0
                if algorithm in ("normuon", "dion3"):
                    extra = _local(state["variance"]).view(-1)
                matrices.append(_Matrix(x.view(-1, cols), grad.view(-1, cols), m.view(-1, cols), extra, rank,
                                        layout, (full_rows, cols), name=self.param_name(p)))
                continue
            if layout == "column_sharded":  # one 2-D block of columns (a rank may hold none)
                extra = _local(state["variance"]).view(-1) if algorithm == "dion3" else None
                matrices.append(_Matrix(x, grad, m, extra, 0, layout, (p.shape[0], p.shape[1]),
                                        name=self.param_name(p)))
                continue
            # "local" shards hold whole matrices of a 3-D batch: the layout of their local shape.
            view = self._view(p, group, shape=tuple(x.shape) if layout == "local" else None)
            extra: list[Any]
            ranks = [0] * view.num_matrices
            if algorithm in ("normuon", "dion3"):
                extra = view.row_vectors(whole_of[p].variance if layout == "gathered" else _local(state["variance"]))
            elif algorithm == "dion":
                ranks = self._dion_ranks(view, group["rank_fraction"])
                # Q holds every matrix of the whole batch; a "local" shard's matrices start further in.
                first = self._local_batch_range(p)[1] * len(view.blocks) if layout == "local" else 0
                extra = [state["Q"][first + i, :, :r] for i, r in enumerate(ranks)]
            else:
                extra = [None] * view.num_matrices
            for xv, gv, mv, e, r in zip(view.matrices(x), view.matrices(grad), view.matrices(m), extra, ranks):
                matrices.append(_Matrix(xv, gv, mv, e, r, layout, tuple(xv.shape), name=self.param_name(p)))

        lr, wd = group["lr"], group["weight_decay"]
        # Keyed by the full shape, so every rank forms the same batches in the same order.
        batches = megabatches(matrices, key=lambda m: (m.full_shape, m.param.dtype, m.param.device, m.rank,
                                                        m.layout, m.sharding.key if m.sharding else None))
        fraction = group.get("fraction", 1.0)
        for batch in (part for whole in batches for part in self._memory_chunks(whole, algorithm, fraction)):
            xs = [m.param for m in batch]
            gs = [m.grad for m in batch]
            ms = [m.momentum for m in batch]
            es = [m.extra for m in batch]
            layout, (rows, cols) = batch[0].layout, batch[0].full_shape
            common = {"lr": lr, "weight_decay_rate": wd, "scale": rules.lr_scale(rows, cols, group["adjust_lr"])}
            orthogonalize = self._orthogonalizer(group) if algorithm != "dion" else None
            checked = _users(group["orthogonalizer"])  # a user's callable: its outputs are checked
            names = list(dict.fromkeys(m.name for m in batch)) if checked else []
            if orthogonalize is not None and checked:
                orthogonalize = self._checked(orthogonalize, names)
            finish = None
            select = None
            # Nothing communicated: the iteration's last product can write into the parameters.
            factors = None
            if layout == "replicated" and self._process_group is None and algorithm == "muon":
                factors = get_factored_orthogonalizer(group["orthogonalizer"] or DEFAULT_ORTHOGONALIZER[algorithm])
                if factors is not None and checked:
                    factors = self._checked_factors(factors, names)
            stack_dtype = self._stack_dtype(group, layout, ms[0])
            if layout == "row_sharded":
                plan = _RowShardedPlan(self._process_group, rows, len(batch), self.comm_stats)
                if algorithm in ("dion2", "dion3"):
                    select = plan.select_rows(group["fraction"], group["selection_scope"])
                if algorithm in ("normuon", "dion3"):
                    finish = plan.around(partial(orthogonalize_and_normalize, orthogonalize=orthogonalize,
                                                 beta2=group["muon_beta2"], eps=group["epsilon"]))
                else:
                    orthogonalize = _first(plan.around(orthogonalize))
            elif layout == "column_sharded":
                columns = ColumnShardedPlan(self._process_group, rows, cols, len(batch), self.comm_stats)
                select = columns.select_rows(num_selected(rows, group["fraction"]))
                if algorithm == "dion3":
                    finish = columns.finish(orthogonalize, group["muon_beta2"], group["epsilon"])
                else:
                    orthogonalize = columns.orthogonalize(orthogonalize)
            elif layout in ("replicated", "gathered"):
                orthogonalize = self._share(orthogonalize)
            if algorithm == "muon":
                rules.muon_update(xs, gs, ms, mu=group["mu"], nesterov=group["nesterov"],
                                  orthogonalize=orthogonalize, factors=factors, stack_dtype=stack_dtype, **common)
            elif algorithm == "normuon":
                rules.normuon_update(xs, gs, ms, es, mu=group["mu"], nesterov=group["nesterov"],
                                     beta2=group["muon_beta2"], eps=group["epsilon"], orthogonalize=orthogonalize,
                                     finish=finish, **common)
            elif algorithm == "dion2":
                rules.dion2_update(xs, gs, ms, fraction=group["fraction"], mu=group["mu"], orthogonalize=orthogonalize,
                                   dim=0 if layout in ("row_sharded", "column_sharded") else None, select=select,
                                   **common)
            elif algorithm == "dion3":
                rules.dion3_update(xs, gs, ms, es, fraction=group["fraction"], mu=group["mu"],
                                   beta2=group["muon_beta2"], eps=group["epsilon"], orthogonalize=orthogonalize,
                                   finish=finish, select=select, **common)
            else:
                spec, columns = batch[0].sharding, slice(None)
                if spec is not None or self._replicate_group is not None:
                    factors = partial(sharded_low_rank_factors, full_rows=rows, full_cols=cols, stats=self.comm_stats,
                                      rows_group=spec.rows_group if spec else None,
                                      cols_group=spec.cols_group if spec else None,
                                      col_offset=spec.col_offset if spec else 0, replicate=self._replicate_group,
                                      sync_free=self.capturable)
                    if spec is not None:
                        columns = slice(spec.col_offset, spec.col_offset + spec.local_cols)
                else:
                    factors = partial(rules.low_rank_factors, qr_method=group["qr_method"], sync_free=self.capturable)
                    if layout in ("replicated", "gathered"):
                        factors = self._share(factors)
                rules.dion_update(xs, gs, ms, es, mu=group["mu"], eps=group["epsilon"], factors=factors,
                                  columns=columns, **common)
        for whole in gathered:
            whole.write_back(lr, wd)
        if algorithm == "dion":
            for p, layout in zip(params, layouts):
                if layout == "local":
                    self._share_local_right_factors(p)

    @staticmethod
    def _expert_mesh_dim(p: Tensor) -> int:
        return next(i for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate))

    def _local_batch_range(self, p: Tensor) -> tuple[int, int, int]:
        """For a ``Shard(0)`` batch of matrices (torch.chunk-style): the mesh dimension it is sharded
        over, the index of this rank's first matrix and how many it holds."""
        dim = self._expert_mesh_dim(p)
        sizes = shard_rows(p.shape[0], p.device_mesh.size(dim))
        rank = p.device_mesh.get_local_rank(dim)
        return dim, sum(sizes[:rank]), sizes[rank]

    def _share_local_right_factors(self, p: Tensor) -> None:
        """Dion on a ``Shard(0)`` batch of matrices: each rank updated the right factors of its own
        matrices; all-gather them, so that Q is the same whole tensor on every rank (as the state of
        every other layout is) and a checkpoint saved from any rank holds every matrix's."""
        q = self.state[p]["Q"]
        per_batch = q.view(p.shape[0], -1, *q.shape[1:])  # [batch, blocks of one matrix, cols, r]
        dim, first, count = self._local_batch_range(p)
        own = per_batch[first: first + count]
        placements = [Shard(0) if i == dim else Replicate() for i in range(p.device_mesh.ndim)]
        whole = DTensor.from_local(own.contiguous(), p.device_mesh, placements, shape=per_batch.shape,
                                   stride=per_batch.stride())
        per_batch.copy_(whole.full_tensor())
        if self.comm_stats is not None:
            self.comm_stats.record("all_gather", q.numel() * q.element_size())

    def _memory_chunks(self, batch: list[_Matrix], algorithm: str, fraction: float = 1.0) -> list[list[_Matrix]]:
        """A big megabatch in up to ``MEMORY_CHUNKS`` parts when nothing is communicated: an
        orthogonalization holds about five temporaries the size of what it orthogonalizes (stacked
        input, X, X Xᵀ, the polynomial, the next X), so a quarter of a whole-matrix batch at a time keeps
        the step's transient memory near 1.25x the batch. Row-selecting rules orthogonalize ``fraction``
        of it: ceil(4·fraction) parts (none at f ≤ 1/4), so their batched calls stay as large as they can.
        Each part still has at least ``CHUNK_MIN_ELEMENTS`` elements to orthogonalize."""
        communicates = self._process_group is not None or self._replicate_group is not None
        if communicates or algorithm == "dion" or batch[0].layout != "replicated":
            return [batch]
        share = fraction if algorithm in ("dion2", "dion3") else 1.0
        work = share * sum(m.param.numel() for m in batch)
        parts = min(MEMORY_CHUNKS, math.ceil(MEMORY_CHUNKS * share - 1e-9), len(batch), int(work // CHUNK_MIN_ELEMENTS))
        if parts <= 1:
            return [batch]
        size = -(-len(batch) // parts)
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def _scalar_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        beta1, beta2 = group["betas"]
        # AdamW batches parameters that share a step count (one bias correction per batch); capturable
        # steps are per-parameter device tensors and are never read on the host.
        counted = group["algorithm"] == "adamw" and not self.capturable
        key = (lambda p: (p.device, p.dtype, float(self.state[p]["step"]))) if counted \
            else (lambda p: (p.device, p.dtype))
        for batch in megabatches(params, key=key):
            # Elementwise rules: each rank updates its own shard, no communication.
            xs = [_local(p) for p in batch]
            grads = [_local(p.grad) for p in batch]
            states = [self.state[p] for p in batch]
            exp_avgs = [_local(s["exp_avg"]) for s in states]
            if group["algorithm"] == "adamw":
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1.0)
                rules.adamw_update(xs, grads, exp_avgs, [_local(s["exp_avg_sq"]) for s in states], steps,
                                   lr=group["lr"], beta1=beta1, beta2=beta2,
                                   eps=group["epsilon"], weight_decay_rate=group["weight_decay"])
            else:
                rules.lion_update(xs, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                                  weight_decay_rate=group["weight_decay"])
