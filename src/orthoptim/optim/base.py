"""The optimizer shell shared by every orthoptim optimizer: groups, options and the step loop.

Each subclass only chooses defaults. Every group may pick any algorithm ("dion3", "dion2", "dion",
"muon", "normuon" for matrices, "adamw", "lion" for the rest); the math lives in ``orthoptim.rules``
and the communication in ``orthoptim.distributed``. The class is assembled from parts, one concern
a file: ``state.py`` (eager state, loading), ``nonfinite.py`` (the gradients' verdict),
``sharding.py`` (DTensor parameters and their layouts), ``user_orthogonalizer.py`` (a user's
callable, checked). This file holds what a step does with them.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import math
import operator
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from orthoptim import rules
from orthoptim.caller_warnings import warn_at_caller
from orthoptim.distributed import CommStats, megabatches, resolve_process_group, split_batch
from orthoptim.distributed.column_exchange import ColumnShardedPlan
from orthoptim.distributed.dtensor import DTensor, local_tensor, shard_rows, storage_address
from orthoptim.distributed.factor_sharding import FactorSharding
from orthoptim.distributed.gather import Gathered
from orthoptim.distributed.low_rank import sharded_low_rank_factors
from orthoptim.distributed.row_exchange import RowShardedPlan
from orthoptim.kernels import cpu_dtype
from orthoptim.optim.capture import capturing
from orthoptim.optim.matrix_view import MatrixView, matrix_view
from orthoptim.optim.nonfinite import GradientChecks, NonFiniteGradientError
from orthoptim.optim.sharding import ShardedParameters
from orthoptim.optim.stacked_state import for_copying, from_copying, restack, stacked_view, stands_alone
from orthoptim.optim.state import OPTIONS_ADDED_LATER, StateKeeping, row_state_dtype
from orthoptim.optim.user_orthogonalizer import CheckedOrthogonalizers, users_own
from orthoptim.optim.validation import (
    MATRIX_ALGORITHMS,
    options_read_by,
    plain_numbers,
    readers_of,
    unread_options,
    validate_group,
)
from orthoptim.orthogonalize import Orthogonalizer, get_factored_orthogonalizer, get_orthogonalizer, input_dtype
from orthoptim.rules.normalization import orthogonalize_and_normalize
from orthoptim.rules.selection import num_selected

__all__ = ["COMMON_DEFAULTS", "NonFiniteGradientError", "OrthonormalOptimizer"]

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
    "transpose": False,
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
# A 3-D parameter whose last dimension is at most this looks like a Conv1d weight's kernel (a warning).
MAX_KERNEL_WIDTH = 7
_PLAIN_TENSORS = {Tensor, torch.nn.Parameter}  # not DTensors, whose data_ptr() is 0
# p.data = p.data.view(torch.float16) keeps the rest. (Not the device: with CUDA's unified addressing no
# two devices' memory shares an address, so a move always changes the storage address.)
_dtype_of = operator.attrgetter("dtype")
# Single process, a megabatch is orthogonalized in up to this many parts of at least this many
# elements (see OrthonormalOptimizer._memory_chunks): transient memory vs the size of batched calls.
MEMORY_CHUNKS = 4
CHUNK_MIN_ELEMENTS = 1 << 20


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


# torch.compiler.disable, but importing torch._dynamo (and triton with it) at the first call rather than
# when orthoptim is imported; torch.optim marks its own methods this way.
_eager_under_compile = getattr(torch, "_disable_dynamo", None) or torch.compiler.disable


# torch.autocast's device types (those this torch build knows, and a registered privateuse1 backend):
# a step called inside the autocast block of the forward pass would have its products rounded to
# bf16/fp16 by autocast, the fp32 iterations silently in bf16, and Dion's in-place error feedback then
# given mixed dtypes (raised half-way through the step).
@lru_cache(maxsize=1)
def _autocast_device_types() -> tuple[str, ...]:
    names = ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia", torch._C._get_privateuse1_backend_name())
    available = []
    for name in dict.fromkeys(names):
        try:
            if torch.amp.is_autocast_available(name):
                available.append(name)
        except RuntimeError:  # a name this build does not know
            pass
    return tuple(available)


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Every autocast that is on is off inside, as in a step called outside the block."""
    with contextlib.ExitStack() as stack:
        for device_type in _autocast_device_types():
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


# The state Dion2 and Dion3 keep as views of one stack per megabatch (``_stack_selection_state``).
_STACKED_STATE = {"dion2": ("momentum",), "dion3": ("momentum", "variance")}


# Names torch.optim's optimizers give options that orthoptim calls otherwise.
_TORCH_NAMES = {"eps": "epsilon", "momentum": "mu", "beta1": "betas", "beta2": "betas",
                "adjust_lr_fn": "adjust_lr", "ns_coefficients": "orthogonalizer", "ns_steps": "orthogonalizer"}
# What the constructors' TypeError adds to such a name, where the two differ in more than the name.
_TORCH_NOTES = {
    "eps": "AdamW's and NorMuon's ε; torch.optim.Muon's eps is Newton-Schulz's guard, which a callable sets: "
           "orthogonalizer=functools.partial(orthoptim.newton_schulz, eps=...)",
    "adjust_lr_fn": "torch's default 'original' is adjust_lr='original', its 'match_rms_adamw' is 'rms_norm'",
    "ns_coefficients": "'newton_schulz' is torch.optim.Muon's default set; others, and other step counts, by "
                       "orthogonalizer=functools.partial(orthoptim.newton_schulz, coefficients=((a, b, c),) * steps)",
}
_TORCH_NOTES["ns_steps"] = _TORCH_NOTES["ns_coefficients"]


def _refuse_a_set(params: Any, what: str) -> None:
    """A set's order changes between runs, and with it the order of the state dict and Dion's initial factors."""
    if isinstance(params, (set, frozenset)):
        raise TypeError(f"{what} is a set, whose order changes between runs (and with it the order of the state "
                        "dict and Dion's initial factors); pass a list")


def _check_lr_device(lr: Any, params: list[Any], where: str) -> None:
    """A tensor lr lives on its group's parameters' device (read by device, not by value: no sync). On
    another one the rules' kernels would fail half-way through a step, or, for a device without data
    (meta), compute garbage. Not moved there: a schedule the caller runs by filling their own tensor
    would then fill a tensor the step no longer reads."""
    if not isinstance(lr, Tensor):
        return
    devices = sorted({str(p.device) for p in params if isinstance(p, Tensor)})
    if devices and devices != [str(lr.device)]:
        raise ValueError(
            f"lr in {where} is a tensor on {lr.device}, but the group's parameters are on {', '.join(devices)}; "
            f"put the lr on their device (torch.tensor({_lr_text(lr)}, device='{devices[0]}')), "
            "keep one device per group, or pass a float")


def _lr_text(lr: Tensor) -> str:
    try:
        return f"{lr.item():.6g}"
    except (RuntimeError, NotImplementedError):  # no data to read (meta)
        return "<the lr's value>"


def _first(fn: Callable[..., tuple[Tensor, ...]]) -> Callable[..., Tensor]:
    return lambda *args: fn(*args)[0]


class OrthonormalOptimizer(StateKeeping, GradientChecks, ShardedParameters, CheckedOrthogonalizers,
                           Optimizer):
    """Base class: validates groups up front, creates state eagerly, megabatches same-shape matrices."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A keyword torch.optim's optimizers spell otherwise (eps=, momentum=) gets its orthoptim name
        # in the TypeError, which Python's own message lacks. The signature is bound first, so the
        # constructor itself runs unwrapped and its own errors pass through untouched.
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def checked_init(self: Any, *args: Any, **kw: Any) -> None:
            unknown = [key for key in kw if key not in signature.parameters]
            hints = [f"{key}= is {_TORCH_NAMES[key]}=" + (f" ({_TORCH_NOTES[key]})" if key in _TORCH_NOTES else "")
                     for key in unknown if key in _TORCH_NAMES]
            # An option of another rule (nesterov= to Dion3): which classes take it, and the group way.
            hints += [f"{key}= is not read by {cls.__name__} (it is by {', '.join(readers_of(key))}: put those "
                      f"parameters in a group with that algorithm)" for key in unknown
                      if key not in _TORCH_NAMES and key in COMMON_DEFAULTS and readers_of(key)]
            if hints and not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
                raise TypeError(f"{cls.__name__}() got unexpected keyword argument(s) {unknown}; in orthoptim "
                                f"{', '.join(hints)}")
            init(self, *args, **kw)

        cls.__init__ = checked_init

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], distributed_mesh: Any = None,
                 replicate_mesh: Any = None, inner_shard_mesh: Any = None, capturable: bool = False) -> None:
        if not isinstance(capturable, bool):
            raise ValueError(f"capturable={capturable!r} must be True or False")
        cpu_dtype.requested()  # a bad ORTHOPTIM_CPU_DTYPE is refused here, by name, not in the first step
        # Capturable: no host sync in step() (see orthoptim.optim.capture); set before groups are added.
        self.capturable = capturable
        self._init_gradient_checks()
        self._init_orthogonalizer_checks()
        self._init_sharding()
        self._process_group = resolve_process_group(distributed_mesh)
        # Data parallel without DDP (Dion's compressed sync): this optimizer averages the gradients.
        self._replicate_group = resolve_process_group(replicate_mesh, "replicate_mesh")
        # Dion's tensor-parallel mesh; its outer_shard_mesh is distributed_mesh.
        self._inner_group = resolve_process_group(inner_shard_mesh, "inner_shard_mesh")
        self.comm_stats: CommStats | None = None  # opt-in: set to a CommStats() to count collectives
        full = plain_numbers({**COMMON_DEFAULTS, **defaults})
        validate_group(full, "the optimizer's defaults")
        self._names: dict[Tensor, str] = {}
        self._positions: dict[Tensor, int] = {}  # order of first appearance: seeds Dion's Q
        # Each group's options and parameters as they were last checked at step time (_check_group_at_step).
        self._checked_groups: dict[int, tuple[Any, ...]] = {}
        # Each group's betas at its last step, for groups whose algorithm does not read them.
        self._betas_seen: dict[int, tuple[float, ...]] = {}
        self._betas_warned: set[int] = set()
        # The transpose option each parameter's per-row state (variance, Dion's Q) was made under.
        self._state_transposed: dict[Tensor, bool] = {}
        # Until the first step, the state tensors the optimizer made (``_record_made_state``).
        self._made_state: dict[Tensor, dict[str, tuple[weakref.ref[Tensor], int | None]]] = {}
        _refuse_a_set(params, "params")  # torch.optim checks this in groups only
        super().__init__(params, full)
        # The state is as the constructor made it (zeros, Dion's seeded Q) until a step or a load:
        # made again by the first step if the model was converted or moved since (``_remake_if_moved``).
        self._state_is_fresh = True
        self._state_checks_deferred = False

    # ----------------------------------------------------------------------------- copies
    def __getstate__(self) -> dict[str, Any]:
        """For ``copy.deepcopy`` and ``pickle``: torch.optim keeps only defaults, state and param_groups,
        which would leave a copy without the names, positions (Dion's Q seeds) and flags its step reads.
        Hooks are dropped, as torch.optim drops them."""
        for option, group in (("distributed_mesh", self._process_group), ("replicate_mesh", self._replicate_group),
                              ("inner_shard_mesh", self._inner_group)):
            if group is not None:
                raise TypeError(
                    f"{type(self).__name__} was built with {option}=..., whose process group cannot be copied or "
                    "pickled; save optimizer.state_dict() and load it into an optimizer built where it is needed")
        # Dropped as torch.optim drops them: hooks, and what shadows a method of the class (an LR
        # scheduler's wrapper of step, bound to the original optimizer: a copy would step that one).
        kept = {key: value for key, value in self.__dict__.items()
                if not (key.startswith("_optimizer_") and key.endswith("_hooks")) and not hasattr(type(self), key)}
        # Weak references do not copy: the copy records its own state's tensors, but only those that
        # are as the optimizer made them (what the user set stays the user's).
        kept["_made_state"] = self._made_keys() if self._state_is_fresh else {}
        # A tensor view pickles its whole storage: views into a stack (stacked_state) go as the stack,
        # once, and where each lies in it.
        kept["state"] = defaultdict(dict, {p: {key: for_copying(value) for key, value in state.items()}
                                           for p, state in self.state.items()})
        return kept

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch.optim's __setstate__ (also run by load_state_dict) adds defaults["differentiable"] = False,
        # which orthoptim does not support; left there, add_param_group's refusal of
        # differentiable=True would see a known key and take the group.
        if not self.defaults.get("differentiable", False):
            self.defaults.pop("differentiable", None)
        for entries in self.state.values():
            for key, value in entries.items():
                entries[key] = from_copying(value)
        # An optimizer pickled by an earlier version lacks what later ones added.
        for name, empty in (("_betas_seen", dict), ("_betas_warned", set), ("_state_transposed", dict),
                            ("_checked_groups", dict), ("_identities", dict)):
            self.__dict__.setdefault(name, empty())
        self.__dict__.setdefault("_orthogonalizer_error", None)
        self.__dict__.setdefault("_state_checks_deferred", False)
        self.__dict__.setdefault("_state_is_fresh", False)
        for key, value in OPTIONS_ADDED_LATER.items():
            self.defaults.setdefault(key, value)
            for group in self.param_groups:
                group.setdefault(key, value)
        if "defaults" in state:  # unpickled or copied (torch.optim's load_state_dict also lands here)
            for group in self.param_groups:  # state standing alone (an older pickle) is stacked again
                self._stack_selection_state(group, from_state=True)
        made_keys = self.__dict__.get("_made_state")  # None: pickled by a version that did not keep them
        self._made_state = {}
        if self._state_is_fresh:  # a copy made before the first step
            self._record_made_state(list(self.state), only=made_keys)

    # ----------------------------------------------------------------------------- groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        index = len(self.param_groups)
        if isinstance(param_group, dict):
            param_group = plain_numbers(param_group)
        # torch.optim keys that would change the result if they were silently ignored.
        for key, fix in (("maximize", "minimize the negated objective (loss = -objective)"),
                         ("differentiable", "its steps run under no_grad and cannot be differentiated through")):
            if param_group.get(key) and key not in self.defaults:
                raise ValueError(f"param group {index} sets {key}={param_group[key]!r}, which orthoptim does not "
                                 f"support: {fix}")
        unknown = sorted(set(param_group) - set(self.defaults) - _BOOKKEEPING_KEYS)
        for key in unknown:
            hint = _TORCH_NAMES.get(key) or next(iter(difflib.get_close_matches(key, list(self.defaults), n=1)), None)
            warn_at_caller(
                f"param group {index} has key {key!r}, which {type(self).__name__} does not read; "
                + (f"did you mean {hint!r}? " if hint else "")
                + f"check its spelling (known keys: {sorted(self.defaults)})")
        merged = {**self.defaults, **param_group}
        validate_group(merged, f"param group {index}")
        for key in unread_options(param_group, merged["algorithm"], set(self.defaults)):
            warn_at_caller(
                f"param group {index} sets {key}={param_group[key]!r}, which algorithm={merged['algorithm']!r} does "
                f"not read (it is read by {', '.join(readers_of(key))}); remove it, or set the algorithm it was "
                "meant for")
        self._check_capturable_options(merged, f"param group {index}")
        raw = param_group["params"]
        _refuse_a_set(raw, f"param group {index}: params")
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p if isinstance(p, tuple) else (None, p)) for p in raw]
        offset = sum(len(g["params"]) for g in self.param_groups)
        names = param_group.get("param_names") or [None] * len(named)
        if len(names) != len(named):
            raise ValueError(f"param group {index} has {len(named)} params but {len(names)} param_names; "
                             "give one name per parameter, in the same order")
        labels = [name or names[j] or f"param_groups[{index}].params[{j}] (#{offset + j})"
                  for j, (name, _) in enumerate(named)]
        first: dict[Tensor, str] = {}  # torch.optim only warns of a parameter listed twice in a group
        for (_, p), label in zip(named, labels):
            if not isinstance(p, Tensor):
                continue  # _check_param names what is not a tensor
            if p in first:
                raise ValueError(f"param group {index} lists {label} twice (also as {first[p]}): it would take "
                                 "its update twice; list each parameter once")
            first[p] = label
        self._check_blocks([p for _, p in named], labels, index)
        for (_, p), label in zip(named, labels):
            self._check_param(p, merged, label)
        self._warn_rows_for_tall(merged, [(p, label) for (_, p), label in zip(named, labels)], index)
        # Not for param_groups' groups (named: it flattens conv weights itself) or a transposed batch.
        if merged["algorithm"] in MATRIX_ALGORITHMS and not (merged["flatten"] or merged["transpose"]) and \
                not {"flatten", "name"} & set(param_group):
            self._warn_kernel_like_batches([(p, label) for (_, p), label in zip(named, labels)], index)
        if self.capturable:  # before the group is added: a refused group must leave no trace
            self._check_one_device([p for _, p in named], index)
        else:
            _check_lr_device(merged["lr"], [p for _, p in named], f"param group {index}")
        # torch.optim wants all groups with param_names or none: a group without them next to named ones
        # (param_groups() names its groups) gets its labels, and the reverse names the earlier groups.
        named_before = [("param_names" in g) for g in self.param_groups]
        names_given = "param_names" in param_group or any(isinstance(p, tuple) for p in raw)
        if not names_given and any(named_before):
            param_group = {**param_group, "param_names": labels}
        elif names_given and named_before and not all(named_before):
            for g in self.param_groups:
                g.setdefault("param_names", [self.param_name(q) for q in g["params"]])
        super().add_param_group({**param_group, "params": raw})
        group = self.param_groups[-1]
        added = [p for p in group["params"] if p not in self._names]
        try:
            if self.capturable:
                self._lr_to_tensor(group, index)
            elif "lr" not in param_group and isinstance(group["lr"], Tensor):
                # An inherited tensor lr is copied: schedulers fill each group's lr in place, and groups
                # sharing one tensor would all take the last group's value.
                group["lr"] = group["lr"].detach().clone()
            for j, (p, label) in enumerate(zip(group["params"], labels)):
                self._names.setdefault(p, label)
                self._positions.setdefault(p, offset + j)
            self._stack_selection_state(group)
            for p in group["params"]:
                self._init_state(p, group)
            self._record_made_state(group["params"])
        except BaseException:
            # Out of memory (or interrupted) while making the group's state: the group is taken out
            # again, so that the call can be retried, instead of a half-made group that refuses it.
            self.param_groups.pop()
            for p in group["params"]:
                self.state.pop(p, None)
                self._made_state.pop(p, None)
            for p in added:
                self._names.pop(p, None)
                self._positions.pop(p, None)
            raise

    @staticmethod
    def _warn_kernel_like_batches(params: list[tuple[Any, str]], index: int) -> None:
        """A 3-D parameter is a batch of matrices (MoE experts); a Conv1d weight [out, in, k] handed over
        without param_groups (which flattens it) would be read as ``out`` matrices of [in, k]: said
        where the last dimension is as short as a kernel's."""
        for p, label in params:
            if isinstance(p, Tensor) and p.ndim == 3 and p.numel() and p.shape[-1] <= MAX_KERNEL_WIDTH:
                warn_at_caller(
                    f"param group {index}: {label} of shape {tuple(p.shape)} is read as {p.shape[0]} matrices of "
                    f"{list(p.shape[1:])} (a 3-D parameter is a batch of matrices, e.g. MoE experts); a Conv1d "
                    "weight [out, in, kernel] needs flatten=True in its group (orthoptim.param_groups sets it). "
                    "Set flatten=False in the group to keep the batch reading without this warning")

    def _warn_rows_for_tall(self, group: dict[str, Any], params: list[tuple[Any, str]], index: int) -> None:
        """Dion2 on one process selects the columns of a tall matrix; row-sharded (FSDP2), it selects rows
        (DESIGN: "unless sharding decides"), so selection_scope='global' is not the one-process result
        there: said once per group, naming the matrices."""
        if group["algorithm"] != "dion2" or group["selection_scope"] != "global":
            return
        tall = [label for p, label in params if isinstance(p, DTensor) and p.ndim >= 2 and
                self._layout(p, group) == "row_sharded" and p.shape[0] > math.prod(p.shape[1:])]
        if tall:
            warn_at_caller(
                f"param group {index}: Dion2 selects rows of the row-sharded matrices {tall}, which are taller than "
                "wide, where one process selects columns; selection_scope='global' gives the one-process result "
                "only for matrices no taller than wide (Dion3 always selects rows, in both cases)")

    def _check_capturable_options(self, group: dict[str, Any], where: str) -> None:
        """Options that need the host during a step, which capturable=True rules out."""
        if not self.capturable:
            return
        if group["selection_scope"] == "global" and group["algorithm"] in ("dion2", "dion3"):
            raise ValueError(
                f"{where}: selection_scope='global' sizes its row exchange from the selected rows "
                "on the host, which capturable=True rules out; use selection_scope='local' or capturable=False"
            )
        if group["nonfinite"] == "skip":
            raise ValueError(
                f"{where}: nonfinite='skip' needs a host sync each step, which capturable=True "
                "rules out; keep nonfinite='raise' (with capturable=True, non-finite gradients are flagged and "
                "optimizer.check_nonfinite() raises after the step) or set capturable=False"
            )
        if group["orthogonalizer"] == "svd" and "orthogonalizer" in options_read_by(group["algorithm"]):
            raise ValueError(
                f"{where}: orthogonalizer='svd' cannot take a non-finite gradient, which capturable=True flags "
                "instead of refusing (torch.linalg.svd would raise half-way through the step, after other groups "
                "had stepped); use a Newton-Schulz orthogonalizer ('polar_express', 'gram') or capturable=False"
            )

    def _check_group_at_step(self, group: dict[str, Any], index: int,
                             owners: Callable[[], dict[Tensor, list[int]]]) -> None:
        """Before a step changes anything: the group's options as they are now (schedules and hand edits
        may have changed them), and what they mean for each parameter: its matrix view (num_heads,
        split_sizes, flatten, a matrix rule on a vector) and the shapes of the state it already has.
        The per-parameter part is redone only when the options, the group's tensors, or a parameter's
        storage, shape, contiguity or dtype differ from the group's last check: ``p.data = ...`` and
        ``model.to(...)`` (dtype, device, memory format) after the optimizer was built give a parameter
        new storage or another shape; a parameter put into the group by hand changes the list. This
        runs every step, so it compares what Python reads cheaply. ``owners()``: each parameter's group
        indices (made once a step, by the first group that needs them)."""
        where = f"param group {index} (at step time)"
        self._validate_at_step(group, where)
        self._check_capturable_options(group, where)
        self._warn_cycled_betas(group, index)
        splits = group["split_sizes"]
        key = (group["algorithm"], group["flatten"], group["transpose"], group["num_heads"],
               tuple(splits) if splits is not None else None, group["rank_fraction"])
        params = group["params"]
        # Which tensors, their storage, shapes, layout and dtype, as cheaply as Python reads them
        # (~0.3 µs a parameter): a view (p.data = p.data.t()) keeps the storage but not the shape or strides.
        plain = set(map(type, params)) <= _PLAIN_TENSORS
        addresses = list(map(Tensor.data_ptr if plain else storage_address, params))
        # A tensor lr on another device than at the last check is checked against the parameters' device
        # (by device only: a fresh tensor each step, as some schedules assign, reruns nothing).
        lr_key = group["lr"].device if isinstance(group["lr"], Tensor) else None
        signature = (key, lr_key, list(map(id, params)), addresses, list(map(Tensor.size, params)),
                     list(map(Tensor.is_contiguous, params)), list(map(_dtype_of, params)))
        if self._checked_groups.get(index) == signature:
            return
        _check_lr_device(group["lr"], params, where)
        # A parameter put into a list by hand a second time would take two updates (two rules' if the
        # lists are two groups'); add_param_group refuses that, and so does a step.
        groups_of = owners()
        for p in params:
            if isinstance(p, Tensor) and p not in self._positions:
                raise ValueError(
                    f"param group {index} holds a parameter of shape {tuple(p.shape)} that was put into "
                    "group['params'] directly; add parameters with optimizer.add_param_group({'params': [...]}), "
                    "which checks them and creates their state")
            if isinstance(p, Tensor) and len(groups_of[p]) > 1:
                other = next((j for j in groups_of[p] if j != index), None)
                where_else = f", and so does param group {other}" if other is not None else " twice"
                raise ValueError(
                    f"param group {index} (at step time) holds {self.param_name(p)}{where_else}: it would take two "
                    "updates; remove the copy from group['params'] (each parameter belongs to one group, once)")
            self._check_param(p, group, self.param_name(p))
            self._check_state_shapes(p, group)
        self._checked_groups[index] = signature

    def _validate_at_step(self, group: dict[str, Any], where: str) -> None:
        # A tensor lr that a scheduler fills in place is read where that is free (a CPU tensor, eager
        # steps); on a GPU, or in a capturable or compiled step, reading it would sync with the device
        # or break the graph, so there it is checked only when it is set.
        lr = group["lr"]
        if isinstance(lr, Tensor) and lr.ndim == 0 and lr.is_floating_point():  # others: refused below
            readable = lr.device.type == "cpu" and not self.capturable and not torch.compiler.is_compiling()
            lr = lr.item() if readable else 0.0
        validate_group({**group, "lr": lr}, where)

    def _warn_cycled_betas(self, group: dict[str, Any], index: int) -> None:
        """A scheduler that cycles momentum (OneCycleLR's and CyclicLR's default cycle_momentum=True)
        writes betas[0] into every group that has betas, and every group has them; the matrix rules
        read mu. Said once per group, the first time its betas differ from its previous step's."""
        if "betas" in options_read_by(group["algorithm"]) or any(isinstance(b, Tensor) for b in group["betas"]):
            return
        betas = tuple(float(b) for b in group["betas"])
        before = self._betas_seen.setdefault(index, betas)
        self._betas_seen[index] = betas
        if betas != before and index not in self._betas_warned:
            self._betas_warned.add(index)
            warn_at_caller(
                f"param group {index}: betas changed from {before} to {betas} between steps (a scheduler with "
                f"cycle_momentum=True, such as OneCycleLR or CyclicLR?), but algorithm={group['algorithm']!r} reads "
                f"mu, not betas: its momentum stays mu={group['mu']}. Pass cycle_momentum=False, or schedule "
                "group['mu'] yourself")

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
                raise ValueError(
                    f"parameter {label} is not contiguous (strides {p.stride()} for shape {tuple(p.shape)}, e.g. "
                    "channels_last); matrix rules work on views of contiguous storage: convert the model first "
                    "(model.to(memory_format=torch.contiguous_format)) and build the optimizer after that")
        if isinstance(p, DTensor):
            self._check_dtensor(p, group, label)

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
            transpose=group["transpose"],
        )

    # ----------------------------------------------------------------------------- the step
    # torch.compile runs the step eagerly (a graph break): traced by dynamo, the step's cached
    # dtype/kernel choices and host reads of check results came out wrong (one matrix's update applied
    # to another, silently). The step's own work is already megabatched and fused; launch overhead on a
    # GPU is what capturable=True and CUDA graphs remove.
    @_eager_under_compile
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Perform one optimization step. Checks every group's options and every gradient first; on a
        bad option it raises, on a non-finite gradient it raises or skips that parameter, per
        ``nonfinite``; either way before any parameter or state has changed. Under ``torch.compile`` the
        step runs eagerly. Inside a ``torch.autocast`` block the closure runs under it, the update
        as outside it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _autocast_off():
            self._step()
        return loss

    def _step(self) -> None:
        """The step after the closure: every check, then each group's update."""
        @cache
        def owners() -> dict[Tensor, list[int]]:  # each parameter's groups, once per step, if a check needs it
            found: dict[Tensor, list[int]] = {}
            for j, g in enumerate(self.param_groups):
                for p in g["params"]:
                    if isinstance(p, Tensor):
                        found.setdefault(p, []).append(j)
            return found
        # What a user's orthogonalizer did in a step that failed half-way is not this step's.
        self._orthogonalizer_problems, self._orthogonalizer_error = [], None
        refusal = None
        try:
            # A group whose options are invalid defers the state checks: its own check refuses the step.
            self._state_checks_deferred = self._state_is_fresh and not self._remake_if_moved()
            for index, group in enumerate(self.param_groups):
                # Options may change between steps (LR schedules, a fraction schedule, a hand edit): a NaN
                # lr, a fraction above 1 or num_heads that do not divide the rows are refused here, before
                # any group is stepped, rather than half-way through the step.
                self._check_group_at_step(group, index, owners)
            work = [(g, [p for p in g["params"] if p.grad is not None]) for g in self.param_groups]
            self._check_gradients([p for _, ps in work for p in ps])
        except Exception as error:  # nothing has changed yet
            # Distributed, the other ranks are about to wait in the verdict's all-reduce: this rank
            # joins it with its refusal, and every rank raises (``_drop_nonfinite``).
            refusal, work = error, [(g, []) for g in self.param_groups]
        work = self._flag_nonfinite(work, refusal) if self.capturable else self._drop_nonfinite(work, refusal)
        if self._replicate_group is not None:
            self._average_gradients(work)
        self._state_is_fresh = False
        self._made_state.clear()
        for group, params in work:
            if not params:
                continue
            # State cleared by hand (opt.state.clear()) is made again in stacks, not one tensor each.
            stacked = group["algorithm"] in _STACKED_STATE
            if stacked and any("momentum" not in self.state.get(p, ()) for p in params):
                self._stack_selection_state(group)
            for p in params:
                self._init_state(p, group)
            if group["algorithm"] in MATRIX_ALGORITHMS:
                self._matrix_step(group, params)
            else:
                self._scalar_step(group, params)
        if any(users_own(g["orthogonalizer"]) for g in self.param_groups):
            self._raise_orthogonalizer_problems()
        if self._replicate_group is not None and not capturing():  # a captured sync would replay every step
            self._steps_since_replica_sync += 1
            if self._replica_sync_every is not None and self._steps_since_replica_sync >= self._replica_sync_every:
                self.synchronize_replicas()

    def _remake_if_moved(self) -> bool:
        """Before the first step: state made for parameters that were converted, moved or resized since
        (``model.to(torch.bfloat16)`` or ``model.cuda()`` after the optimizer was built, which torch.optim's
        lazily made state allows), or under a ``transpose`` edited since, is made again for every
        parameter as a new optimizer would make it (zeros, Dion's Q from the same seed; capturable
        learning rates on the new device), and what the user set in it by hand (a ported momentum)
        written back, converted to the parameter's dtype and device. Not while a group's options are
        invalid: the step's checks then refuse them with nothing changed (False: not made again for that reason)."""
        if not self._state_moved():
            return True
        for index, group in enumerate(self.param_groups):
            try:
                self._validate_at_step(group, f"param group {index}")
            except ValueError:
                return False
        hand_set = self._state_set_by_hand()
        for group in self.param_groups:  # named here: else the step's checks would name the first moved state
            for p in group["params"]:
                if p in hand_set:
                    self._check_set_by_hand(p, group, hand_set[p])
        saved = (dict(self.state), dict(self._state_transposed), [g["lr"] for g in self.param_groups])
        try:
            self.state.clear()
            self._state_transposed.clear()
            self._checked_groups.clear()
            for index, group in enumerate(self.param_groups):
                if self.capturable:
                    self._lr_to_tensor(group, index)
                self._stack_selection_state(group)
                for p in group["params"]:
                    self._init_state(p, group)
            # Made again: a refused step leaves a state that a later remake must again tell from the user's.
            self._record_made_state(list(self.state))
            self._restore_set_by_hand(hand_set)
        except BaseException as error:  # left as it was
            self.state.clear()
            self.state.update(saved[0])
            self._state_transposed.clear()
            self._state_transposed.update(saved[1])
            for group, lr in zip(self.param_groups, saved[2]):
                group["lr"] = lr
            if not isinstance(error, ValueError):  # a shape the options do not allow: the checks name it
                raise
        return True

    def _state_moved(self) -> bool:
        for group in self.param_groups:
            params = [p for p in group["params"] if isinstance(p, Tensor)]
            if self.capturable and params and isinstance(group["lr"], Tensor):
                dtype = functools.reduce(torch.promote_types, (p.dtype for p in params), torch.float32)
                if (group["lr"].device, group["lr"].dtype) != (params[0].device, dtype):  # as _lr_to_tensor makes it
                    return True
            for p in params:
                state = self.state.get(p)
                if not state:
                    continue
                try:
                    expected = self._expected_state_shapes(p, group)
                except Exception:  # options the parameter's new shape breaks: the step's checks say which
                    return True
                if self._misshapen_state(state, expected) is not None:
                    return True
                made = self._state_transposed.get(p)
                if made is not None and made != group["transpose"]:
                    return True
                for key, value in state.items():
                    if not isinstance(value, Tensor):
                        continue
                    if key == "step":
                        where = local_tensor(p).device if self.capturable else torch.device("cpu")
                        if local_tensor(value).device != where:
                            return True
                    elif (value.dtype, value.device) != (row_state_dtype(p) if key == "variance" else p.dtype,
                                                         p.device):
                        return True
        return False

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

    def _share(self, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        """Distributed: each rank computes its share of a batch function and all-gathers the rest."""
        if self._process_group is None:
            return fn
        return split_batch(fn, self._process_group, self.comm_stats)

    def _matrix_step(self, group: dict[str, Any], params: list[Tensor]) -> None:
        """One step of a matrix group: every parameter cut into matrices, same-shape matrices batched,
        the group's rule on each batch, then what the layouts need afterwards (gathered blocks written
        back, Dion's right factors of expert shards shared)."""
        layouts = [self._layout(p, group) for p in params]
        to_gather = [p for p, layout in zip(params, layouts) if layout == "gathered"]
        gathered = Gathered.gather_all(to_gather, [self.state[p] for p in to_gather], self.comm_stats)
        whole_of = dict(zip(to_gather, gathered))
        matrices = [m for p, layout in zip(params, layouts)
                    for m in self._matrices_of(p, group, layout, whole_of.get(p))]
        # Keyed by the full shape, so every rank forms the same batches in the same order.
        batches = megabatches(matrices, key=lambda m: (m.full_shape, m.param.dtype, m.param.device, m.rank,
                                                        m.layout, m.sharding.key if m.sharding else None))
        algorithm, fraction = group["algorithm"], group.get("fraction", 1.0)
        for batch in (part for whole in batches for part in self._memory_chunks(whole, algorithm, fraction)):
            self._batch_step(group, batch)
        for whole in gathered:
            whole.write_back(group["lr"], group["weight_decay"])
        if algorithm == "dion":
            for p, layout in zip(params, layouts):
                if layout == "local":
                    self._share_local_right_factors(p)

    def _matrices_of(self, p: Tensor, group: dict[str, Any], layout: str, whole: Gathered | None) -> list[_Matrix]:
        """The matrices of ``p`` under its ``layout``: in-place-writable views of the parameter, its
        gradient and state (of ``whole``'s copies for the "gathered" layout)."""
        algorithm, state, name = group["algorithm"], self.state[p], self.param_name(p)
        if whole is not None:
            x, m, grad = whole.delta, whole.momentum, whole.grad
        else:
            x, m = local_tensor(p), local_tensor(state["momentum"])
            grad = local_tensor(p.grad)
            grad = grad if grad.is_contiguous() else grad.contiguous()
        if layout == "factor_sharded":
            spec = self._factor_spec(p)
            rank = self._dion_ranks(self._view(p, group), group["rank_fraction"])[0]
            shape = (spec.local_rows, spec.local_cols)
            return [_Matrix(x.view(shape), grad.view(shape), m.view(shape), state["Q"][0, :, :rank], rank,
                            layout, (p.shape[0], math.prod(p.shape[1:])), spec, name)]
        if layout == "row_sharded":
            # One local row block of the full matrix; blocks (heads, splits) are rejected up front.
            full_rows, cols = p.shape[0], math.prod(p.shape[1:])
            expected = shard_rows(full_rows, dist.get_world_size(self._process_group))
            if x.shape[0] != expected[dist.get_rank(self._process_group)]:
                raise ValueError(
                    f"parameter {name}: local shard has {x.shape[0]} rows but Shard(0) of "
                    f"{full_rows} rows gives {expected}; only torch.chunk-style (FSDP2) sharding is supported"
                )
            variance = local_tensor(state["variance"]).view(-1) if algorithm in ("normuon", "dion3") else None
            return [_Matrix(x.view(-1, cols), grad.view(-1, cols), m.view(-1, cols), variance, 0, layout,
                            (full_rows, cols), name=name)]
        if layout == "column_sharded":  # one 2-D block of columns (a rank may hold none)
            variance = local_tensor(state["variance"]).view(-1) if algorithm == "dion3" else None
            return [_Matrix(x, grad, m, variance, 0, layout, (p.shape[0], p.shape[1]), name=name)]
        # "local" shards hold whole matrices of a 3-D batch: the layout of their local shape.
        view = self._view(p, group, shape=tuple(x.shape) if layout == "local" else None)
        extra: list[Any]
        ranks = [0] * view.num_matrices
        if algorithm in ("normuon", "dion3"):
            extra = view.row_vectors(whole.variance if whole is not None else local_tensor(state["variance"]))
        elif algorithm == "dion":
            ranks = self._dion_ranks(view, group["rank_fraction"])
            # Q holds every matrix of the whole batch; a "local" shard's matrices start further in.
            first = self._local_batch_range(p)[1] * len(view.blocks) if layout == "local" else 0
            extra = [state["Q"][first + i, :, :r] for i, r in enumerate(ranks)]
        else:
            extra = [None] * view.num_matrices
        return [_Matrix(xv, gv, mv, e, r, layout, tuple(xv.shape), name=name)
                for xv, gv, mv, e, r in zip(view.matrices(x), view.matrices(grad), view.matrices(m), extra, ranks)]

    def _batch_step(self, group: dict[str, Any], batch: list[_Matrix]) -> None:
        """The group's rule on one megabatch, given the hooks its layout needs."""
        algorithm = group["algorithm"]
        xs, gs, ms, es = ([getattr(m, key) for m in batch] for key in ("param", "grad", "momentum", "extra"))
        layout, (rows, cols) = batch[0].layout, batch[0].full_shape
        common = {"lr": group["lr"], "weight_decay_rate": group["weight_decay"],
                  "scale": rules.lr_scale(rows, cols, group["adjust_lr"])}
        if algorithm == "dion":
            factors, columns = self._dion_factors(group, batch)
            rules.dion_update(xs, gs, ms, es, mu=group["mu"], eps=group["epsilon"], factors=factors,
                              columns=columns, **common)
            return
        orthogonalize, finish, select, factors = self._orthogonalize_hooks(group, batch)
        if algorithm == "muon":
            rules.muon_update(xs, gs, ms, mu=group["mu"], nesterov=group["nesterov"], orthogonalize=orthogonalize,
                              factors=factors, stack_dtype=self._stack_dtype(group, layout, ms[0]), **common)
        elif algorithm == "normuon":
            rules.normuon_update(xs, gs, ms, es, mu=group["mu"], nesterov=group["nesterov"],
                                 beta2=group["muon_beta2"], eps=group["epsilon"], orthogonalize=orthogonalize,
                                 finish=finish, **common)
        elif algorithm == "dion2":
            stacked = self._selection_stacks(batch, _STACKED_STATE["dion2"]) if select is None else None
            dim = 0 if layout in ("row_sharded", "column_sharded") else None
            rules.dion2_update(xs, gs, ms, fraction=group["fraction"], mu=group["mu"], orthogonalize=orthogonalize,
                               dim=dim, select=select, stacked=stacked[0] if stacked else None, **common)
        else:
            stacked = self._selection_stacks(batch, _STACKED_STATE["dion3"]) if select is None else None
            rules.dion3_update(xs, gs, ms, es, fraction=group["fraction"], mu=group["mu"],
                               beta2=group["muon_beta2"], eps=group["epsilon"], orthogonalize=orthogonalize,
                               finish=finish, select=select, stacked=stacked, **common)

    @property
    def _communicates(self) -> bool:
        """Whether steps run collectives (a distributed_mesh, or Dion's replicate_mesh)."""
        return self._process_group is not None or self._replicate_group is not None

    def _selection_stacks(self, batch: list[_Matrix], keys: tuple[str, ...]) -> tuple[Tensor, ...] | None:
        """The batch's state ``keys`` (momenta [B, m, n], Dion3's variances [B, m]) as views of one
        tensor each, where they are a run of a stack (``_stack_selection_state``) or the equally spaced
        matrices of one 3-D parameter; else None, and the per-matrix ops run. Only where the batched
        ops reduce as the per-matrix ones do: contiguous matrices, on CPUs of at most
        ``selection.L1_CHUNK_ELEMENTS`` elements (``l1_norms`` sums larger ones block by block)."""
        if batch[0].layout != "replicated" or self._communicates:
            return None
        fields = {"momentum": "momentum", "variance": "extra"}
        stacks = [stacked_view([getattr(m, fields[key]) for m in batch]) for key in keys]
        if any(stack is None for stack in stacks) or not stacks[0].is_contiguous():
            return None
        if stacks[0].device.type == "cpu" and stacks[0][0].numel() > rules.selection.L1_CHUNK_ELEMENTS:
            return None
        return tuple(stacks)

    def _stack_selection_state(self, group: dict[str, Any], *, from_state: bool = False) -> None:
        """Dion2/Dion3 on one process: the momenta (and Dion3's variances) of the group's whole matrices
        of one shape, dtype and device made views of one zero tensor each (``optim.stacked_state``), in
        the order the step batches them, so that its row selection runs batched. Called before the
        group's state is made (each tensor is made once, in its stack); ``from_state``: the state is
        there, standing alone (an unpickled copy), and is copied into stacks. Not for sharded or
        communicated layouts, parameters of several matrices, or on CPUs matrices of more than
        ``selection.L1_CHUNK_ELEMENTS`` elements (their block-by-block passes beat batched ones)."""
        if group["algorithm"] not in _STACKED_STATE or self._communicates:
            return
        keys = _STACKED_STATE[group["algorithm"]]

        def stackable(p: Tensor) -> bool:
            if type(p) not in (torch.nn.Parameter, Tensor) or self._layout(p, group) != "replicated":
                return False
            if p.device.type == "cpu" and p.numel() > rules.selection.L1_CHUNK_ELEMENTS:
                return False
            state = self.state.get(p, {})
            ready = all(type(state.get(key)) is Tensor and stands_alone(state[key]) and state[key].is_contiguous()
                        for key in keys) if from_state else not any(key in state for key in keys)
            return ready and self._view(p, group).num_matrices == 1

        for params in megabatches([p for p in group["params"] if stackable(p)],
                                  key=lambda p: (tuple(p.shape), p.dtype, p.device)):
            if len(params) < 2:
                continue
            p0 = params[0]
            if from_state:
                for key in keys:
                    for p, t in zip(params, restack([self.state[p][key] for p in params])):
                        self.state[p][key] = t
                continue
            momenta = torch.zeros((len(params), *p0.shape), dtype=p0.dtype, device=p0.device)
            for p, m in zip(params, momenta.unbind(0)):
                self.state[p]["momentum"] = m
            if "variance" in keys:  # as _row_state makes it: [1, rows] of at least fp32
                rows = self._view(p0, group).rows
                variances = torch.zeros((len(params), 1, rows), dtype=row_state_dtype(p0), device=p0.device)
                for p, v in zip(params, variances.unbind(0)):
                    self.state[p]["variance"] = v
                    self._state_transposed[p] = group["transpose"]

    def _orthogonalize_hooks(self, group: dict[str, Any], batch: list[_Matrix]) -> tuple[Any, Any, Any, Any]:
        """What the orthogonalizing rules call for one megabatch, as (orthogonalize, finish, select,
        factors): the group's orthogonalizer (checked if it is the user's), wrapped in the layout's
        communication; ``finish`` (orthogonalize + normalize where the whole rows are) and ``select``
        (the row selection of sharded matrices) where the layout needs them; and, single process,
        Muon's factored orthogonalizer, whose last product writes into the parameters."""
        algorithm = group["algorithm"]
        layout, (rows, cols) = batch[0].layout, batch[0].full_shape
        orthogonalize = self._orthogonalizer(group)
        checked = users_own(group["orthogonalizer"])  # a user's callable: its outputs are checked
        names = list(dict.fromkeys(m.name for m in batch)) if checked else []
        if checked:
            orthogonalize = self._checked(orthogonalize, names)
        finish = select = factors = None
        if layout == "replicated" and self._process_group is None and algorithm == "muon":
            factors = get_factored_orthogonalizer(group["orthogonalizer"] or DEFAULT_ORTHOGONALIZER[algorithm])
            if factors is not None and checked:
                factors = self._checked_factors(factors, names)
        if layout == "row_sharded":
            plan = RowShardedPlan(self._process_group, rows, len(batch), self.comm_stats)
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
        return orthogonalize, finish, select, factors

    def _dion_factors(self, group: dict[str, Any], batch: list[_Matrix]) -> tuple[Callable[..., Tensor], slice]:
        """Dion's low-rank factors for one megabatch, and the columns of Q this rank updates: all-reduced
        over the shard and replicate groups where the matrices are factor-sharded or their gradients
        unsynchronized, else computed here (a share of the batch per rank under DDP)."""
        layout, (rows, cols), spec = batch[0].layout, batch[0].full_shape, batch[0].sharding
        if spec is None and self._replicate_group is None:
            factors = partial(rules.low_rank_factors, qr_method=group["qr_method"], sync_free=self.capturable)
            return (self._share(factors) if layout in ("replicated", "gathered") else factors), slice(None)
        factors = partial(sharded_low_rank_factors, full_rows=rows, full_cols=cols, stats=self.comm_stats,
                          rows_group=spec.rows_group if spec else None,
                          cols_group=spec.cols_group if spec else None,
                          col_offset=spec.col_offset if spec else 0, replicate=self._replicate_group,
                          sync_free=self.capturable)
        columns = slice(spec.col_offset, spec.col_offset + spec.local_cols) if spec is not None else slice(None)
        return factors, columns

    def _memory_chunks(self, batch: list[_Matrix], algorithm: str, fraction: float = 1.0) -> list[list[_Matrix]]:
        """A big megabatch in up to ``MEMORY_CHUNKS`` parts when nothing is communicated: an
        orthogonalization holds about five temporaries the size of what it orthogonalizes (stacked
        input, X, X Xᵀ, the polynomial, the next X), so a quarter of a whole-matrix batch at a time keeps
        the step's transient memory near 1.25x the batch. Row-selecting rules orthogonalize ``fraction``
        of it: ceil(4·fraction) parts (none at f ≤ 1/4), so their batched calls stay as large as they can.
        Each part still has at least ``CHUNK_MIN_ELEMENTS`` elements to orthogonalize."""
        if self._communicates or algorithm == "dion" or batch[0].layout != "replicated":
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
            xs = [local_tensor(p) for p in batch]
            # A gradient of another dtype (torch 2.13's p.grad_dtype: fp32 gradients of bf16 weights) is
            # rounded to the parameter's first (the matrix rules add it into the momentum unrounded):
            # torch's foreach and fused kernels take one dtype (the fused AdamW refused the pair after
            # the matrix groups had stepped). For fp16, the verdict refuses one that would overflow.
            grads = [g if g.dtype == x.dtype else g.to(x.dtype) for g, x in
                     zip((local_tensor(p.grad) for p in batch), xs)]
            states = [self.state[p] for p in batch]
            exp_avgs = [local_tensor(s["exp_avg"]) for s in states]
            if group["algorithm"] == "adamw":
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1.0)
                rules.adamw_update(xs, grads, exp_avgs, [local_tensor(s["exp_avg_sq"]) for s in states], steps,
                                   lr=group["lr"], beta1=beta1, beta2=beta2,
                                   eps=group["epsilon"], weight_decay_rate=group["weight_decay"])
            else:
                rules.lion_update(xs, grads, exp_avgs, lr=group["lr"], beta1=beta1, beta2=beta2,
                                  weight_decay_rate=group["weight_decay"])
