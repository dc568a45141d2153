"""Optimizer state: created eagerly for every parameter (the same keys and shapes on every rank, so
distributed checkpoints load), and checked when a state dict is loaded.

``StateKeeping`` is a part of ``OrthonormalOptimizer`` (``optim/base.py``); it reads the
optimizer's ``state``, ``param_groups``, ``capturable``, ``_positions``, ``param_name``, its matrix
views and layouts (``_view``, ``_layout``) and its parameter check (``_check_param``), and clears
``_checked_groups`` (the step-time checks' memory) when a state dict is loaded, and averages Dion's
momenta over ``replicate_mesh`` when one is taken (``ShardedParameters.synchronize_replicas``).
"""

from __future__ import annotations

import numbers
import weakref
from collections import OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor

from orthoptim.caller_warnings import warn_at_caller
from orthoptim.distributed.dtensor import DTensor, Replicate, Shard, local_tensor
from orthoptim.optim.matrix_view import MatrixView
from orthoptim.optim.stacked_state import stands_alone
from orthoptim.optim.validation import MATRIX_ALGORITHMS, options_read_by, validate_group
from orthoptim.orthogonalize import normalize_columns
from orthoptim.rules.selection import ceil_fraction


def _version(t: Any) -> int | None:
    """A tensor's in-place version counter (a DTensor's: its local shard's); None for other values."""
    if not isinstance(t, Tensor) or t.is_inference():  # an inference tensor keeps no version
        return None
    return local_tensor(t)._version


# Seed of Dion's random initial right factors: fixed, so every rank and every run starts alike.
DION_Q_SEED = 20250405


# How state_dict() writes a callable orthogonalizer: code cannot be saved in a checkpoint that
# torch.load(weights_only=True) reads, so the name stands in for it, and loading keeps the callable
# of the optimizer it is loaded into.
CALLABLE_MARK = "callable:"
# Group options added after the first release, with the value every group had before: a state dict
# saved before an option existed was made under that value.
OPTIONS_ADDED_LATER: dict[str, Any] = {"transpose": False}


def _callable_name(fn: Callable[..., Any]) -> str:
    while isinstance(fn, partial):
        fn = fn.func
    return f"{CALLABLE_MARK}{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def row_state_dtype(p: Tensor) -> torch.dtype:
    """The per-row variance is an EMA of small numbers: at least fp32, whatever the parameter's dtype."""
    return torch.promote_types(p.dtype, torch.float32)


# The state of each rule that holds one entry per row of the matrix as read (so depends on ``transpose``).
_PER_ROW_STATE = {"normuon": "variance", "dion3": "variance", "dion": "Q"}
# Group options that change what a rule computes (a state dict that changes one gets a warning).
_RULE_OPTIONS = ("algorithm", "fraction", "rank_fraction", "selection_scope", "nesterov", "orthogonalizer")


class StateKeeping:
    """State creation (``_init_state``), its expected shapes, and a checked ``load_state_dict``."""

    @staticmethod
    def _check_one_device(params: list[Tensor], index: int) -> None:
        """Capturable groups keep their lr on their parameters' device: refuse a group spread over several."""
        devices = {p.device for p in params if isinstance(p, Tensor)}
        if len(devices) > 1:
            raise ValueError(f"param group {index} holds parameters on {sorted(map(str, devices))}; with "
                             "capturable=True each group's parameters must be on one device")

    @classmethod
    def _lr_to_tensor(cls, group: dict[str, Any], index: int) -> None:
        """A 0-dim tensor on the parameters' device, in fp32 (fp64 for a group with fp64 parameters,
        whose 1 − lr·wd and lr·s would otherwise be rounded to fp32): a captured graph reads it at
        replay, and LR schedulers fill it in place (assigning a new float would be ignored by the graph)."""
        cls._check_one_device(group["params"], index)
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        dtype = torch.float32
        for p in group["params"]:
            dtype = torch.promote_types(dtype, p.dtype)
        lr = group["lr"]
        # A copy per group: groups that inherit one default must not share the tensor a scheduler fills.
        if isinstance(lr, Tensor):
            group["lr"] = lr.detach().to(device=device, dtype=dtype, copy=True).reshape(())
        else:
            group["lr"] = torch.tensor(float(lr), dtype=dtype, device=device)

    @staticmethod
    def _dion_ranks(view: MatrixView, rank_fraction: float) -> list[int]:
        return [max(1, ceil_fraction(rank_fraction, min(r, c))) for r, c in view.block_shapes()]

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
            step_device = local_tensor(p).device if self.capturable else "cpu"
            # fp32 whatever the default dtype: the dtype torch's fused kernel takes and load_state_dict restores.
            needed = {"step": lambda: torch.tensor(0.0, dtype=torch.float32, device=step_device),
                      "exp_avg": lambda: torch.zeros_like(p), "exp_avg_sq": lambda: torch.zeros_like(p)}
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
                if key == "variance":
                    self._state_transposed[p] = group["transpose"]
        if algorithm == "dion":
            view = self._view(p, group)
            shape = self._dion_q_shape(view, group["rank_fraction"])
            if "Q" in state and tuple(state["Q"].shape) != shape:
                raise ValueError(self._state_shape_error(p, group, "Q", tuple(state["Q"].shape), shape))
            if "Q" not in state:
                self._state_transposed[p] = group["transpose"]
                gen = torch.Generator().manual_seed(DION_Q_SEED + self._positions[p])
                q = normalize_columns(torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu"),
                                      group["epsilon"])
                state["Q"] = q.to(device=p.device, dtype=p.dtype)

    def _record_made_state(self, params: list[Tensor], *, only: dict[Tensor, list[str]] | None = None) -> None:
        """Until the first step: the state tensors the optimizer made for ``params`` (weakly held: one the
        user replaces is freed) and their in-place version, so that the remake of moved state
        (``_remake_if_moved``) tells them from what the user set or wrote by hand (a ported momentum:
        docs/porting.md), which it keeps. ``only``: the keys to record of each parameter (a copy's)."""
        for p in params:
            self._made_state[p] = {key: (weakref.ref(value), _version(value))
                                   for key, value in self.state.get(p, {}).items()
                                   if isinstance(value, Tensor) and (only is None or key in only.get(p, ()))}

    def _state_set_by_hand(self) -> dict[Tensor, dict[str, Any]]:
        """Each parameter's state entries that are not as the optimizer made them: replaced, added, or
        written in place. (A stack's views share one version: a write into one marks its whole stack,
        whose other entries then hold what was made, which is kept alike.)"""
        found: dict[Tensor, dict[str, Any]] = {}
        for p, state in self.state.items():
            made = self._made_state.get(p, {})
            for key, value in state.items():
                record = made.get(key)
                if record is None or record[0]() is not value or _version(value) != record[1]:
                    found.setdefault(p, {})[key] = value
        return found

    def _made_keys(self) -> dict[Tensor, list[str]]:
        """Each parameter's state keys as the optimizer made them (for a copy, ``__getstate__``)."""
        hand_set = self._state_set_by_hand()
        return {p: [key for key in state if key not in hand_set.get(p, {})] for p, state in self.state.items()}

    def _restore_set_by_hand(self, hand_set: dict[Tensor, dict[str, Any]]) -> None:
        """After the state was made again: what the user had set goes back into it, converted to the
        dtype and device made for it, as a load converts it (``_check_set_by_hand`` has refused what a
        load refuses)."""
        for p, entries in hand_set.items():
            state = self.state[p]
            for key, value in entries.items():
                made = state.get(key)
                if isinstance(made, Tensor) and isinstance(value, numbers.Real) and not isinstance(value, bool):
                    made.fill_(value)  # a step count set as a number
                    continue
                if not (isinstance(made, Tensor) and isinstance(value, Tensor)):
                    state[key] = value
                    continue
                try:
                    made.copy_(value.reshape(made.shape))
                except RuntimeError as error:
                    raise TypeError(
                        f"parameter {self.param_name(p)}: its state {key!r}, set by hand before the first step, "
                        f"cannot be converted to the {made.dtype} {type(made).__name__} on {made.device} that the "
                        f"parameter needs ({error}); set it as one, or set it after model.to(...)") from error

    def _check_set_by_hand(self, p: Tensor, group: dict[str, Any], entries: dict[str, Any]) -> None:
        """Refuse state set by hand that the remake could not convert: a shape the parameter's state does
        not have, or what a load refuses (an integer or complex tensor, a non-number step count)."""
        try:
            expected = self._expected_state_shapes(p, group)
        except Exception:  # options the parameter's shape breaks: the step's checks say which
            return
        wrong = self._misshapen_state(entries, expected)
        if wrong is not None:
            raise ValueError(self._state_shape_error(p, group, *wrong))
        malformed = self._malformed_state(entries, expected)
        if malformed is not None:
            key, what = malformed
            raise ValueError(
                f"parameter {self.param_name(p)}: its state {key!r}, set by hand, is {what}, where "
                f"{group['algorithm']} keeps "
                + ("a step count (a number or a one-element tensor)" if key == "step" else "a floating-point tensor")
                + "; set it as one")

    def _row_state(self, p: Tensor, group: dict[str, Any]) -> Tensor:
        """Zeros [batch, rows] in fp32 (fp64 for fp64 parameters); for a DTensor parameter a DTensor,
        sharded like its rows where the step works on row shards, else replicated (it is small)."""
        dtype = row_state_dtype(p)
        view = self._view(p, group)
        if not isinstance(p, DTensor):
            return torch.zeros(view.batch, view.rows, device=p.device, dtype=dtype)
        if self._layout(p, group) not in ("row_sharded", "local"):
            return DTensor.from_local(torch.zeros(view.batch, view.rows, device=local_tensor(p).device, dtype=dtype),
                                      p.device_mesh, [Replicate()] * p.device_mesh.ndim)
        local = local_tensor(p)
        # Shard(0) splits the rows of a matrix (dim 1 of [1, rows]) or the batch of a 3-D tensor (dim 0).
        batched = p.ndim == 3 and not group["flatten"]  # a batch of matrices: its rows are whole
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

    def _state_shape_error(self, p: Tensor, group: dict[str, Any], key: str, has: tuple[int, ...],
                           needs: tuple[int, ...]) -> str:
        """The message for a state tensor whose shape the group's current options no longer give."""
        options = {"flatten": group["flatten"], "transpose": group["transpose"], "num_heads": group["num_heads"],
                   "split_sizes": group["split_sizes"]}
        if group["algorithm"] == "dion":
            options["rank_fraction"] = group["rank_fraction"]
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        return (f"parameter {self.param_name(p)}: its state {key!r} has shape {has} but {group['algorithm']} "
                f"needs {needs} for the parameter's shape {tuple(p.shape)} under the group's options now ({shown}); "
                "these fix the shape of the state, so keep the parameter's shape and these options as they were "
                "when the state was made, or start from a fresh optimizer")

    @staticmethod
    def _misshapen_state(state: dict[str, Any], expected: dict[str, tuple[int, ...]],
                         ) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
        """The first tensor of ``state`` whose shape is not the ``expected`` one
        (``_expected_state_shapes``): (key, has, needs)."""
        for key, shape in expected.items():
            value = state.get(key)
            if isinstance(value, Tensor) and tuple(value.shape) != shape and not (key == "step" and value.numel() == 1):
                return key, tuple(value.shape), shape
        return None

    def _check_state_shapes(self, p: Tensor, group: dict[str, Any]) -> None:
        """Refuse existing state of ``p`` whose shape ``group``'s options (edited since) no longer give,
        and per-row state (NorMuon/Dion3's variance, Dion's Q) made under the other ``transpose``: of a
        square matrix it has the same shape, but its entries belong to the other axis. Not while the
        first step defers them (``_remake_if_moved``): a group's invalid options refuse the step then."""
        if self._state_checks_deferred:
            return
        state = self.state.get(p)  # .get: indexing the defaultdict would add an entry
        if state and (bad := self._misshapen_state(state, self._expected_state_shapes(p, group))) is not None:
            raise ValueError(self._state_shape_error(p, group, *bad))
        for key, value in (state or {}).items():
            if key == "step" or not isinstance(value, Tensor):
                continue
            dtype = row_state_dtype(p) if key == "variance" else p.dtype
            if (value.dtype, value.device) != (dtype, p.device):
                raise ValueError(
                    f"parameter {self.param_name(p)} is {p.dtype} on {p.device} but its state {key!r} is "
                    f"{value.dtype} on {value.device}: the parameter was converted or moved (model.to(...)) "
                    "after the optimizer was built. Build the optimizer after converting the model, or bring "
                    "the state along with opt.load_state_dict(opt.state_dict()), which casts and moves it to "
                    "the parameters")
        key = _PER_ROW_STATE.get(group["algorithm"])
        made = self._state_transposed.get(p)
        if state and key in state and made is not None and made != group["transpose"]:
            raise ValueError(
                f"parameter {self.param_name(p)}: its state {key!r} was made with transpose={made} and the group "
                f"now has transpose={group['transpose']}; that state belongs to the rows of the matrix as it was "
                "read then, so keep transpose as it was, or start from a fresh optimizer")

    def _warn_reordered_names(self, state_dict: dict[str, Any]) -> None:
        """State is loaded by position: where both sides name their parameters and the names are the
        same ones in another order, each parameter would take another's state (same shapes pass every
        check). torch.distributed.checkpoint maps state by name itself: it hands over the parameters'
        names as ``params``, in this optimizer's order, next to the saved ``param_names`` as they were,
        so there the order of those says nothing and nothing is compared."""
        saved_groups = state_dict.get("param_groups", [])
        if not (all("param_names" in g for g in saved_groups) and all("param_names" in g for g in self.param_groups)):
            return
        if any(isinstance(i, str) for g in saved_groups for i in g.get("params", ())):
            return  # params named by torch.distributed.checkpoint
        saved_names = [n for g in saved_groups for n in g["param_names"]]
        names = [n for g in self.param_groups for n in g["param_names"]]
        if saved_names != names and sorted(map(str, saved_names)) == sorted(map(str, names)):
            at = next(i for i, (a, b) in enumerate(zip(saved_names, names)) if a != b)
            warn_at_caller(
                f"the loaded state dict names the same parameters as this optimizer in another order: parameter "
                f"#{at} is {saved_names[at]!r} there and {names[at]!r} here. load_state_dict maps state by "
                "position, so each would take another's state: build the param groups in the saved order (the "
                "state dict's param_groups[i]['param_names'])")

    def _check_loadable(self, state_dict: dict[str, Any]) -> bool:
        """Refuse a state dict that would make a later step fail or silently use state of another shape:
        checked before anything is loaded, so a refused one leaves this optimizer as it was. False where
        the groups or their sizes differ, which torch.optim's own load refuses."""
        saved_groups = state_dict.get("param_groups")
        for index, saved in enumerate(saved_groups if isinstance(saved_groups, list) else []):
            if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
                raise ValueError(f"param group {index} of the loaded state dict has no 'params' list; load a state "
                                 f"dict saved by {type(self).__name__}.state_dict()")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups) or any(
                len(g.get("params", ())) != len(mine["params"]) for g, mine in zip(saved_groups, self.param_groups)):
            return False  # torch.optim's own checks name these mismatches
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
                entry = saved_state.get(i, {})
                expected = self._expected_state_shapes(p, merged)
                bad = self._misshapen_state(entry, expected)
                if bad is not None:
                    key, has, needs = bad
                    raise ValueError(
                        f"parameter {label}: the loaded state {key!r} has shape {has} but "
                        f"{merged['algorithm']} needs {needs} for this parameter of shape {tuple(p.shape)}; "
                        "the state dict was saved for other parameters (or other group options) than "
                        "this optimizer's, in this order")
                if entry and not any(key in entry for key in expected):
                    # Nothing of this rule's state (another parameter's, e.g. states listed in another order,
                    # or another optimizer's): the step would start this parameter afresh and keep the rest.
                    raise ValueError(
                        f"parameter {label}: the loaded state has keys {sorted(map(str, entry))} but "
                        f"{merged['algorithm']} keeps {sorted(expected)}; the state dict was saved for other "
                        "parameters (or another optimizer) than this one's, in this order")
                missing = [key for key in expected if key not in entry]
                if entry and missing:
                    warn_at_caller(
                        f"parameter {label}: the loaded state has no {missing}; the next step makes "
                        f"{'it' if len(missing) == 1 else 'them'} afresh (zeros; an AdamW step count from 0)")
                bad_entry = self._malformed_state(entry, expected)
                if bad_entry is not None:
                    key, what = bad_entry
                    raise ValueError(
                        f"parameter {label}: the loaded state {key!r} is {what}, where {merged['algorithm']} keeps "
                        + ("a step count (a number or a one-element tensor)" if key == "step" else
                           "a floating-point tensor") + "; the state dict was not saved by this optimizer, or "
                        "was edited since")
        return True

    @staticmethod
    def _malformed_state(state: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> tuple[str, str] | None:
        """The first entry of ``state`` under an ``expected`` key that the step could not use: a non-tensor
        (or an integer tensor) where a state tensor belongs, a step count that is no real number.
        torch.optim loads anything; the step would then fail half-way (after other groups stepped).
        (key, what it is)."""
        for key in expected:
            if key not in state:
                continue
            value = state[key]
            if isinstance(value, Tensor) and value.device.type == "meta":
                return key, "a tensor on meta (which holds no values)"
            if key == "step":
                number = isinstance(value, numbers.Real) and not isinstance(value, bool)
                if number or (isinstance(value, Tensor) and value.numel() == 1 and value.dtype != torch.bool
                              and not value.is_complex()):
                    continue
            elif isinstance(value, Tensor) and value.is_floating_point():
                continue
            what = f"a {value.dtype} tensor" if isinstance(value, Tensor) else f"a {type(value).__name__}"
            return key, what
        return None

    def state_dict(self) -> dict[str, Any]:
        """torch.optim's state dict, with each callable orthogonalizer written as its name (see
        ``CALLABLE_MARK``), so that ``torch.load(weights_only=True)`` reads it. With ``replicate_mesh``
        it is a collective (call it on every rank): Dion's momenta are averaged over the replicas first
        (``synchronize_replicas``), so that the state of any one rank is the whole state."""
        self.synchronize_replicas()
        state_dict = super().state_dict()
        for group in state_dict["param_groups"]:
            if callable(group.get("orthogonalizer")):
                group["orthogonalizer"] = _callable_name(group["orthogonalizer"])
        return state_dict

    def _as_loaded_here(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with each saved group as this optimizer loads it (``_own_callable``, then
        ``_options_of_older_versions``); a different number of groups is left to torch.optim's check."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            return state_dict  # torch.optim's own check names the mismatch
        groups = []
        for index, (saved, mine) in enumerate(zip(saved_groups, self.param_groups)):  # a loop: warnings name the caller
            if isinstance(saved, dict):
                saved = self._options_of_older_versions(index, self._own_callable(index, saved, mine), mine)
            groups.append(saved)
        return {**state_dict, "param_groups": groups}

    @staticmethod
    def _own_callable(index: int, saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
        """A saved callable's name replaced by this optimizer's orthogonalizer for the group (a warning
        when that is not a callable of the same name, for a group whose algorithm reads it)."""
        name = saved.get("orthogonalizer")
        if not (isinstance(name, str) and name.startswith(CALLABLE_MARK)):
            return saved
        own = mine["orthogonalizer"]
        reads = "orthogonalizer" in options_read_by(saved.get("algorithm", mine["algorithm"]))
        if reads and (not callable(own) or _callable_name(own) != name):
            warn_at_caller(
                f"param group {index} of the loaded state dict was saved with the orthogonalizer "
                f"{name[len(CALLABLE_MARK):]} (a callable, which a state dict cannot hold); the group "
                f"keeps this optimizer's orthogonalizer={own!r}")
        return {**saved, "orthogonalizer": own}

    @staticmethod
    def _options_of_older_versions(index: int, saved: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
        """The value each option the saved group lacks (``OPTIONS_ADDED_LATER``) had before it existed:
        the group's state was made under it (a warning where this optimizer's group has another one)."""
        missing = {k: v for k, v in OPTIONS_ADDED_LATER.items() if k not in saved}
        for key, value in missing.items():
            if mine.get(key, value) != value and saved.get("algorithm", mine["algorithm"]) in MATRIX_ALGORITHMS:
                warn_at_caller(
                    f"param group {index} of the loaded state dict was saved before the {key!r} option "
                    f"existed, so with {key}={value!r}, under which its state was made; the group takes "
                    f"{key}={value!r} (this optimizer's group had {mine[key]!r})")
        return {**saved, **missing} if missing else saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch.optim runs the load pre-hooks inside its load_state_dict, after which the checks and the
        # variance copy below would read the dict as given, not as a hook remapped or completed it; so
        # the hooks run here first, and the post-hooks after this optimizer's own work on the loaded state.
        state_dict = dict(state_dict)
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:  # as torch.optim: any returned dict replaces it
                state_dict = result
        pre, post = self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        try:
            self._load_checked(state_dict)
        finally:  # the same dicts back: the hooks' RemovableHandles refer to them
            self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = pre, post
        for hook in list(post.values()):
            hook(self)

    def _load_checked(self, state_dict: dict[str, Any]) -> None:
        # Called by load_state_dict only: its warnings' stack levels count that frame.
        state_dict = self._as_loaded_here(state_dict)
        matches = self._check_loadable(state_dict)
        self._checked_groups.clear()  # the next step checks the loaded options and state afresh
        self._state_is_fresh = False  # loaded state is kept as it is
        self._made_state.clear()
        self._steps_since_replica_sync = 0  # every replica loads the same momenta
        # torch.optim casts every floating state tensor to the parameter's dtype; the per-row variance
        # is at least fp32 by design, so it is taken from the saved copy rather than the rounded one.
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = state_dict["state"]
        before = [dict(g) for g in self.param_groups]
        # Capturable: every tensor a captured graph may hold; else the state tensors in a stack
        # (``stacked_state``), which stay views of it.
        held = {p: (dict(self.state[p]) if self.capturable else
                    {k: v for k, v in self.state[p].items() if type(v) is Tensor and not stands_alone(v)})
                for p in params if p in self.state}
        self._warn_reordered_names(state_dict)
        kept: list[set[str]] = []
        if matches:
            # Warned before anything is loaded: under warnings-as-errors a refused load changes nothing.
            self._warn_changed_rule_options(state_dict["param_groups"])
            # What each parameter's rule keeps: the conversions below touch those keys only (torch.optim
            # loads any other key as it is; converting one could fail after the state was replaced).
            kept = [set(self._expected_state_shapes(p, {**g, **{k: v for k, v in sg.items() if k != "params"}}))
                    for sg, g in zip(state_dict["param_groups"], self.param_groups) for p in g["params"]]
        super().load_state_dict(state_dict)  # refuses what does not match
        self._betas_seen.clear()  # the loaded betas are the new reference
        for group, old in zip(self.param_groups, before):
            for key, value in old.items():  # keys a state dict of an older version lacks keep their values
                group.setdefault(key, value)
            if "param_names" in old:  # they name this optimizer's parameters, not the saved ones
                group["param_names"] = old["param_names"]
        self._state_transposed.clear()  # the loaded per-row state is laid out as its group says
        for group in self.param_groups:
            for p in group["params"]:
                if _PER_ROW_STATE.get(group["algorithm"]) in self.state.get(p, {}):
                    self._state_transposed[p] = group["transpose"]
        for i, p, keys in zip(ids, params, kept):
            variance = saved.get(i, {}).get("variance") if "variance" in keys else None
            if variance is not None:
                self.state[p]["variance"] = variance.to(device=p.device, dtype=row_state_dtype(p), copy=True)
            # .get: a parameter without saved state gets no entry
            step = self.state.get(p, {}).get("step") if "step" in keys else None
            # The fp32 0-dim count AdamW keeps, where _init_state keeps it: on the device for capturable
            # steps (read there), else on the host (a count saved on a GPU, by a capturable or fused
            # optimizer, would make the step fail after other groups had stepped). Counts saved as a
            # number, an integer or a [1] tensor become that too.
            device = local_tensor(p).device if self.capturable else torch.device("cpu")
            if step is not None and not (isinstance(step, Tensor) and step.ndim == 0 and
                                         step.dtype == torch.float32 and step.device == device):
                self.state[p]["step"] = torch.as_tensor(step, dtype=torch.float32, device=device).reshape(())
        if self.capturable:
            for index, group in enumerate(self.param_groups):
                self._lr_to_tensor(group, index)
        self._load_into_held_tensors(held, before if self.capturable else None)

    def _warn_changed_rule_options(self, saved_groups: list[dict[str, Any]]) -> None:
        """The options that decide what a rule does (not lr, which schedules own) that the loaded groups
        change: a silent change of one would leave the optimizer the caller built running another rule."""
        for index, (saved, old) in enumerate(zip(saved_groups, self.param_groups)):
            group = {**old, **saved}  # as the group is after the load
            reads = options_read_by(group["algorithm"])
            changed = [k for k in _RULE_OPTIONS if (k == "algorithm" or k in reads) and group.get(k) != old.get(k)
                       and not callable(group.get(k)) and not callable(old.get(k))]  # a callable: _own_callable
            if changed:
                sets = ", ".join(f"{k}={group[k]!r}" for k in changed)
                had = ", ".join(f"{k}={old.get(k)!r}" for k in changed)
                warn_at_caller(
                    f"param group {index}: the state dict sets {sets} where this {type(self).__name__}'s group "
                    f"had {had}; as in torch.optim, the saved hyperparameters win, so the group now runs with "
                    f"them (what you want when a schedule of yours set them). Otherwise build the optimizer the "
                    f"checkpoint was saved from, or set {', '.join(f'group[{k!r}]' for k in changed)} back after "
                    "loading")

    def _load_into_held_tensors(self, held: dict[Tensor, dict[str, Any]], groups: list[dict[str, Any]] | None) -> None:
        """The loaded values copied into the tensors the optimizer held before (each state tensor of
        ``held``, and with ``groups`` each lr, of the same shape, dtype and device): capturable, so that
        a captured CUDA graph, which reads and writes those addresses, replays with the loaded state
        instead of the replaced one; and state in a stack, which stays batched."""
        def keep(old: Any, new: Any) -> Any:
            if isinstance(old, Tensor) and isinstance(new, Tensor) and old is not new and \
                    (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device) and \
                    type(old) is type(new):
                old.copy_(new)
                return old
            return new

        for group, old in zip(self.param_groups, groups or []):
            group["lr"] = keep(old["lr"], group["lr"])
        # A loaded tensor may be a view of the held ones themselves (this optimizer's own state_dict(),
        # its entries permuted): copied first, or one copy would overwrite the source of a later one.
        # (A held tensor torch.optim left in place, as it does for a state dict of this optimizer's own
        # dtypes and devices, is never written: it needs no copy.)
        def storage(t: Tensor) -> int:
            return local_tensor(t).untyped_storage().data_ptr()

        held_storages = {storage(t) for old in held.values() for t in old.values() if isinstance(t, Tensor)}
        # .get: self.state is a defaultdict, and a held parameter the state dict has no state for gets none.
        for p, old in held.items():
            for key, value in self.state.get(p, {}).items():
                if isinstance(value, Tensor) and value is not old.get(key) and storage(value) in held_storages:
                    self.state[p][key] = value.clone()
        for p, old_state in held.items():
            state = self.state.get(p, {})
            for key, value in list(state.items()):
                state[key] = keep(old_state.get(key), value)
