"""The step's verdict on its gradients, taken before anything is written: is each gradient finite,
and does each float16 momentum fit float16 this step? Distributed, every rank agrees on one table.

``GradientChecks`` is a part of ``OrthonormalOptimizer`` (``optim/base.py``); it reads the
optimizer's groups, state, names, meshes (``_process_group``, ``_replicate_group``,
``_inner_group``), ``capturable``, ``comm_stats`` and, for float16 matrices, their views, layouts
and shard counts (``_view``, ``_layout``, ``ShardedParameters._shard_counts``).
"""

from __future__ import annotations

import math
import numbers
import zlib
from functools import reduce
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.caller_warnings import warn_at_caller
from orthoptim.distributed.dtensor import DTensor, Replicate, local_tensor
from orthoptim.optim.capture import capturing
from orthoptim.optim.validation import MATRIX_ALGORITHMS, options_read_by
from orthoptim.rules.momentum import add_scaled


def _checked_keys(group: dict[str, Any], capturable: bool) -> list[str]:
    """The options of ``group`` the checksum covers: what its algorithm reads (a user's own keys cannot
    change a collective, and their repr may differ by process: a set's order, an address). The lr too
    where it is a number and the step eager: a schedule stepped on a rank's own metric (ReduceLROnPlateau
    on an unreduced loss) would otherwise step replicas apart silently; each change rebuilds the
    checksum, one small host-to-device copy. A tensor lr is not read on the host, and a captured step
    cannot take a rebuilt checksum: there the lr is not checked."""
    return [key for key in options_read_by(group["algorithm"])
            if key in group and (key != "lr" or (not capturable and not isinstance(group[key], Tensor)))]


def _described(value: Any) -> str:
    """A group option as the checksum reads it: a callable by its name (its repr holds an address), a
    number by its value (np.float64(0.01), 0.01 and a 1 for 1.0 are the same option)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return repr(float(value))
    if isinstance(value, (tuple, list)):
        return repr(type(value)(_described(v) for v in value))
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    return repr(value)


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or Inf, or a finite one would overflow a float16 momentum this step.

    Raised before any parameter or state is changed; with ``capturable=True`` the step cannot read
    the verdict, and ``check_nonfinite()`` raises it afterwards (the step has then been applied).
    """


# How many sets of parameters with gradients an eager step keeps the verdict's device index for.
EAGER_VERDICT_INDICES = 8


class GradientChecks:
    """Non-finite gradients and float16 overflow: refused or skipped (eager steps), or flagged on the
    device for ``check_nonfinite`` (capturable steps)."""

    def _init_gradient_checks(self) -> None:
        # Capturable: a device flag, set by any step since the last check_nonfinite().
        self.nonfinite_found: Tensor | None = None
        # Capturable: per set of parameters with gradients (by identity), its per-parameter flags.
        self._flag_sets: dict[tuple[int, ...], tuple[list[Tensor], Tensor]] = {}
        self._verdict_index: dict[tuple, Tensor] = {}  # see _positions_among
        # A parameter's mesh dimensions, where it is sharded over one none of the optimizer's meshes
        # covers (see _verdict_groups).
        self._beyond_meshes: dict[Tensor, list] = {}
        self._checksums: tuple[tuple, Tensor] | None = None  # see _options_checksum
        self._identities: dict[Tensor, bytes] = {}  # see _identity_bytes

    def _check_grad_placements(self, params: list[Tensor]) -> None:
        """A DTensor parameter's gradient must be laid out as the parameter: the step reads each rank's
        block of both as the same rows and columns. Checked once every rank agrees which parameters have
        gradients (DTensor metadata is global, so then every rank raises alike, and none is left in a
        collective). A ``Partial`` gradient over ``replicate_mesh`` is each replica's own gradient, as
        Dion's compressed sync wants it; elsewhere (a replicated weight under a batch-sharded input)
        it is a sum still to be taken, which the caller must take, as also a gradient sharded another way."""
        replicas = tuple(dist.get_process_group_ranks(self._replicate_group)) if self._replicate_group else None
        for p in params:
            g = p.grad
            if not (isinstance(p, DTensor) or isinstance(g, DTensor)):
                continue
            name = self.param_name(p)
            if not (isinstance(p, DTensor) and isinstance(g, DTensor)):
                kinds = ["a DTensor" if isinstance(t, DTensor) else "a plain tensor" for t in (p, g)]
                raise ValueError(f"parameter {name} is {kinds[0]} but its gradient is {kinds[1]}; give it a "
                                 "gradient of the same kind (as autograd does), e.g. distribute_tensor(grad, "
                                 "p.device_mesh, p.placements); no parameter or state was changed")
            if g.device_mesh != p.device_mesh:
                raise ValueError(f"parameter {name} lives on {p.device_mesh} but its gradient on {g.device_mesh}; "
                                 "give it a gradient on the parameter's mesh; no parameter or state was changed")
            for dim, (mine, theirs) in enumerate(zip(p.placements, g.placements)):
                if mine == theirs or p.device_mesh.size(dim) == 1:
                    continue  # one rank on that dim: every placement is the whole tensor
                if isinstance(mine, Replicate) and theirs.is_partial() and replicas is not None and tuple(
                        dist.get_process_group_ranks(p.device_mesh.get_group(dim))) == replicas:
                    continue  # each replica's own gradient, which compressed sync reduces
                raise ValueError(
                    f"parameter {name} has placements {tuple(p.placements)} but its gradient "
                    f"{tuple(g.placements)} (a Partial gradient is a sum still to be taken, e.g. of a "
                    "replicated weight whose input is sharded over the batch); lay it out as the parameter "
                    "before the step: p.grad = p.grad.redistribute(p.device_mesh, p.placements); no "
                    "parameter or state was changed")

    def _check_gradients(self, params: list[Tensor]) -> None:
        """Gradients the step cannot take at all: refused by name before the verdict."""
        for p in params:
            if p.grad.is_sparse:
                raise ValueError(
                    f"parameter {self.param_name(p)} has a sparse gradient; orthoptim needs dense ones: build "
                    "the embedding with sparse=False, or give this parameter to torch.optim.SparseAdam instead")
            if p.grad.shape != p.shape:
                raise ValueError(
                    f"parameter {self.param_name(p)} has shape {tuple(p.shape)} but its gradient has "
                    f"shape {tuple(p.grad.shape)}; a gradient set by hand must have its parameter's shape"
                )
            if not p.grad.is_floating_point():
                # torch lets any dtype through once p.grad_dtype is None; an integer gradient would be
                # stepped with, a complex one fails inside the verdict's reduction.
                raise ValueError(
                    f"parameter {self.param_name(p)} has a gradient of dtype {p.grad.dtype}; gradients must be "
                    f"real floating point (set p.grad_dtype = p.dtype, or convert the gradient before the step)")

    def _finite(self, params: list[Tensor], groups: list[dict[str, Any]], everyone: list[Tensor],
                verdict_groups: list[dist.ProcessGroup], refused: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """Two bools per parameter (``groups[i]`` is the group of ``params[i]``), on the device, agreed
        on by every rank: is its gradient finite, and does this step's momentum fit its dtype (see
        ``_momentum_fits``)? Distributed, also three bools per parameter of the optimizer ([3, N], else
        None): does it have a gradient on some ranks and none on others, do its group's options differ
        between ranks, and (every column alike) did some rank refuse this step (``refused``: this one
        did, and takes part with no ``params``). ``everyone``, ``verdict_groups``: see ``_verdict_scope``."""
        # One reduction pass over all gradients, and (eager steps) one host read of the verdict.
        grads = [local_tensor(p.grad) for p in params]
        # A rank whose parameters have no gradients this step still takes part in the verdict.
        device = grads[0].device if grads else local_tensor(everyone[0]).device

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
        # parameters have a gradient: rows are bad gradient, bad momentum, has a gradient, has none,
        # then the two bytes of a checksum of the parameter's name, shape, dtype and options and their complements
        # (under MAX, a byte and its complement sum to 255 only if every rank had the same byte), then
        # whether a rank refused the step (the others would wait for it in their next collective).
        index = self._positions_among(params, everyone, device)
        # index_copy_/index_fill_ rather than item assignment: a Python value assigned through an index
        # becomes a fresh host tensor, a copy a CUDA graph cannot hold.
        table = torch.zeros(9, len(everyone), dtype=torch.uint8, device=device)
        table[0].index_copy_(0, index, (~finite).to(torch.uint8))
        table[1].index_copy_(0, index, (~fits).to(torch.uint8))
        table[2].index_fill_(0, index, 1)
        table[3].fill_(1).index_fill_(0, index, 0)
        if refused:  # nothing else of this rank's is read (its groups may be what it refused)
            table[8].fill_(1)
        else:
            table[4:8].copy_(self._options_checksum(everyone, device))
        for group in verdict_groups:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
            if self.comm_stats is not None:
                self.comm_stats.record("all_reduce", table.numel() * table.element_size())
        checksum = table[4:8].to(torch.int16)
        differs = (checksum[:2] + checksum[2:] != 255).any(0)
        return table[0, index] == 0, table[1, index] == 0, torch.stack([(table[2] & table[3]).bool(), differs,
                                                                        table[8].bool()])

    def _options_checksum(self, everyone: list[Tensor], device: torch.device) -> Tensor:
        """[4, len(everyone)] bytes: for each parameter, a 16-bit checksum of its name, shape and dtype,
        its group's options (``_checked_keys``) and the optimizer's ``capturable`` and
        ``replica_sync_every``, and its complement. Ranks built with different
        options (a fraction, a rank, a selection scope) would otherwise exchange messages of different
        sizes: gloo aborts the process, or the ranks wait for each other forever; ranks that list
        their parameters in another order would pair one matrix's rows with another's. Rebuilt only
        when the options change (a capturable step makes no host-to-device copy)."""
        described = tuple(tuple(sorted((key, _described(g[key])) for key in _checked_keys(g, self.capturable)))
                          for g in self.param_groups)
        # The constructor's options that change the step's collectives (a capturable step gathers Dion's
        # Householder factors every step; replicas average their momenta every replica_sync_every steps).
        built = (("capturable", self.capturable), ("replica_sync_every", self._replica_sync_every))
        key = (tuple(map(id, everyone)), described, built)
        if self._checksums is None or self._checksums[0] != key:
            # An lr schedule rebuilds this every eager step: each parameter's own part is hashed once
            # (``_identity_bytes``), its group's chained onto it.
            sums = []
            for g, d in zip(self.param_groups, described):
                start = zlib.crc32(repr((d, built)).encode())
                sums += [zlib.crc32(self._identity_bytes(p), start) & 0xFFFF for p in g["params"]]
            rows = torch.tensor(sums, dtype=torch.int32)
            rows = torch.stack([rows >> 8, rows & 0xFF]).to(torch.uint8)
            rows = torch.cat([rows, 255 - rows])
            if device.type == "cuda" and not capturing():  # from pinned memory, without waiting for the stream
                rows = rows.pin_memory().to(device, non_blocking=True)
            self._checksums = (key, rows.to(device))  # (in a capture: a copy, which capture refuses, loudly)
        return self._checksums[1]

    def _identity_bytes(self, p: Tensor) -> bytes:
        """``p``'s name, shape and dtype, as the checksum reads them (kept per parameter)."""
        if p not in self._identities:
            self._identities[p] = repr((self.param_name(p), tuple(p.shape), str(p.dtype))).encode()
        return self._identities[p]

    def _positions_among(self, params: list[Tensor], everyone: list[Tensor], device: torch.device) -> Tensor:
        """Where ``params`` sit in ``everyone``, as a device index: built once per set of parameters
        (by identity), so a capturable step makes no host-to-device copy."""
        # Keyed by both sequences of identities: the index depends on nothing else. Capturable, entries
        # stay (a captured graph may read one after an eager step with other parameters); eager, only
        # the last few sets are kept, or steps whose parameters with gradients vary (layer drop, MoE
        # experts without tokens) would add one per set, for good.
        key = (tuple(map(id, everyone)), tuple(map(id, params)))
        index = self._verdict_index.pop(key, None)
        if index is None:
            position = {id(p): i for i, p in enumerate(everyone)}
            index = torch.tensor([position[id(p)] for p in params], dtype=torch.long, device=device)
        self._verdict_index[key] = index  # the most recent last
        if not self.capturable and len(self._verdict_index) > EAGER_VERDICT_INDICES:
            del self._verdict_index[next(iter(self._verdict_index))]
        return index

    def _raise_if_mixed(self, mixed: Tensor, refusal: Exception | None = None) -> None:
        """``mixed``: [3, parameters], gradients on some ranks only, options that differ by rank, and
        whether a rank refused the step (``refusal``: this rank's reason, if it did)."""
        if refusal is not None:
            raise refusal
        if bool(mixed[2].any()):
            raise ValueError(
                "another rank refused this step (its error says why: an option, a parameter or a gradient "
                "there); every rank raises rather than wait for it. Nothing was changed")
        differs = [self.param_name(p) for p, d in zip(self._all_params(), mixed[1].tolist()) if d]
        if differs:
            raise ValueError(
                f"parameters {differs} differ between ranks: in their param groups' options (e.g. lr, fraction, "
                "rank_fraction, selection_scope, algorithm) or the optimizer's (capturable, replica_sync_every), "
                "or in name, shape, dtype or position; build the "
                "optimizer from the same parameters in the same order and with the same options, and change "
                "them the same way, on every rank (a scheduler stepped on a rank's own metric, e.g. "
                "ReduceLROnPlateau on an unreduced loss, changes lr on some ranks only). Nothing was changed")
        names = [self.param_name(p) for p, m in zip(self._all_params(), mixed[0].tolist()) if m]
        raise ValueError(
            f"parameters {names} have a gradient on some ranks and none on others; every rank must give the "
            "same parameters gradients (set unused ones to zeros, e.g. p.grad = torch.zeros_like(p), or use "
            "the same model code on every rank). Nothing was changed")

    def _momentum_fits(self, params: list[Tensor], groups: list[dict[str, Any]], device: torch.device) -> Tensor:
        """False where an fp16 matrix's momentum (or, for Dion, its products with B = M + G) would
        overflow fp16 this step although the gradient is finite: the step would turn its weights
        into NaN; and where an fp16 AdamW/Lion parameter's wider gradient would overflow when rounded
        to fp16. fp16 tops out at 65504; bf16 and wider hold nearly fp32's range, and are True
        unless a float64 gradient would overflow the narrower parameter's dtype (an fp32 gradient
        within 0.2 % of fp32's largest value would overflow bf16 too: not checked).
        For such a matrix: one temporary of the new momentum rounded to fp16 as the step rounds it
        (inf exactly where the step's would), a max or row/column norms over it, nothing for other dtypes."""
        fits = torch.ones(len(params), dtype=torch.bool, device=device)
        second_moments: list[tuple[int, Tensor, Tensor, float]] = []  # fp16 AdamW parameters
        for i, (p, group) in enumerate(zip(params, groups)):
            if p.dtype != torch.float16:
                g = local_tensor(p.grad)
                if g.dtype == torch.float64 and p.dtype != torch.float64 and g.numel():
                    # Every rule takes a float64 gradient (p.grad_dtype = None) into state of the
                    # parameter's dtype: a finite 1e300 would be inf there (the weights then NaN).
                    fits[i] = torch.isfinite(g.abs().amax().to(p.dtype)).to(device)
                continue
            if group["algorithm"] not in MATRIX_ALGORITHMS:
                g = local_tensor(p.grad)
                if not g.numel():
                    continue
                # AdamW and Lion take the gradient in the parameter's dtype (``_scalar_step``): a wider
                # one above 65504 would become inf there (the moments inf, the weights NaN).
                if g.dtype != torch.float16:
                    fits[i] = torch.isfinite(g.abs().amax().to(torch.float16)).to(device)
                if group["algorithm"] == "adamw":
                    second_moments.append((i, p, g, group["betas"][1]))
                continue
            momentum = self.state.get(p, {}).get("momentum")
            if momentum is None or not local_tensor(momentum).numel():
                continue
            m, g = local_tensor(momentum), local_tensor(p.grad)
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
                    b, blocks, (row_shards, col_shards) = view.as_batch(b), view.blocks, (1, 1)
                else:  # this rank's block of sharded matrices
                    b = b if batched else b.reshape(1, m.shape[0], -1)
                    blocks, (row_shards, col_shards) = ((0, b.shape[1]),), self._shard_counts(p, batched)
                # torch.stack, not Python's max: comparing 0-dim tensors would read each one back.
                cols = torch.stack([torch.linalg.vector_norm(b[:, start:start + n], dim=-2, dtype=torch.float32).amax()
                                    for start, n in blocks]).amax() * math.sqrt(row_shards)
                rows = torch.linalg.vector_norm(b, dim=-1, dtype=torch.float32).amax() * math.sqrt(col_shards)
                size = torch.maximum(rows, cols)
            else:
                # As the rule computes it, rounded to fp16, so inf exactly where it overflows: M ← G + μM
                # (``momentum.add_scaled``), and with Nesterov B = G + μM, also in fp16 (fp16 momenta
                # are stacked in fp16: ``_stack_dtype``).
                mu = 1.0 if group["algorithm"] in ("dion2", "dion3") else group["mu"]
                nesterov = group["algorithm"] in ("muon", "normuon") and group["nesterov"]
                new = add_scaled(g, m, mu, out=torch.empty_like(m))
                size = new.abs().amax()
                if nesterov:
                    size = torch.maximum(size, add_scaled(g, new, mu, out=torch.empty_like(m)).abs().amax())
            fits[i] = size.to(device=device, dtype=torch.float32) <= top
        if second_moments:
            self._second_moments_fit(second_moments, fits, device)
        return fits

    def _second_moments_fit(self, entries: list[tuple[int, Tensor, Tensor, float]], fits: Tensor,
                            device: torch.device) -> None:
        """fp16 AdamW: v ← β₂v + (1 − β₂)g², computed in fp32 by the kernels and stored in fp16, is inf
        above 65504 (|g| ≳ 8100 with β₂ = 0.999), and the weights then stop moving for good. The bound
        β₂·max v + (1 − β₂)·max g² clears nearly every step with one host read for all of them; the
        exact check (two fp32 temporaries) runs where it does not, and in capturable steps, which
        cannot read the bound."""
        top = torch.finfo(torch.float16).max
        states = [local_tensor(self.state.get(p, {}).get("exp_avg_sq", torch.zeros(0))) for _, p, _, _ in entries]
        if not self.capturable:
            bounds = torch.stack([
                (1.0 - beta2) * g.abs().amax().float() ** 2 + (beta2 * v.abs().amax().float() if v.numel() else 0.0)
                for (_, _, g, beta2), v in zip(entries, states)])
            entries_states = [(e, v) for e, v, b in zip(entries, states, bounds.tolist()) if b > top]
        else:
            entries_states = list(zip(entries, states))
        for (i, _, g, beta2), v in entries_states:
            second = g.float().square().mul_(1.0 - beta2)
            if v.numel():
                second.add_(v.float(), alpha=beta2)
            fits[i] &= torch.isfinite(second.amax().to(torch.float16)).to(device)

    def _flag_nonfinite(self, work: list[tuple[dict, list[Tensor]]],
                        refusal: Exception | None = None) -> list[tuple[dict, list[Tensor]]]:
        """Capturable: record which gradients are non-finite without reading the verdict back.
        ``refusal``: see ``_drop_nonfinite``."""
        params = [p for _, ps in work for p in ps]
        # A rank without gradients still joins the verdict's all-reduce.
        everyone, verdict_groups = self._verdict_scope(refused=refusal is not None)
        if refusal is not None and not verdict_groups:
            raise refusal
        if params or verdict_groups:
            finite, fits, mixed = self._finite(params, [g for g, ps in work for _ in ps], everyone, verdict_groups,
                                               refused=refusal is not None)
            # Ranks that disagree on which parameters have gradients would hang in the next collective:
            # checked with a host read, except while a CUDA graph is being captured (the eager warm-up
            # steps before a capture have checked the same set of parameters; a rank's refusal is
            # raised there only).
            if refusal is not None and capturing():
                raise refusal
            if mixed is not None and not capturing() and bool(mixed.any()):
                self._raise_if_mixed(mixed, refusal)
            self._check_grad_placements(params)
            bad = ~(finite & fits)
            # One pair of buffers per set of parameters with gradients, the same every step: a captured
            # graph writes the ones check_nonfinite reads, also when eager steps run in between. OR-ed
            # in, not copied: the flags hold every step since the last check_nonfinite, which may come
            # many steps later.
            key = tuple(map(id, params))
            held = self._flag_sets.get(key)
            if held is None:
                self._flag_sets[key] = (params, bad)
            else:
                held[1].logical_or_(bad)
            if self.nonfinite_found is None:
                self.nonfinite_found = bad.any()
            else:
                self.nonfinite_found.logical_or_(bad.any())
        return work

    def check_nonfinite(self) -> None:
        """Capturable optimizers: raise if a step since the last call saw a non-finite gradient (reads
        one flag from the device; call it outside the captured step, e.g. every few steps). The flags
        are cleared when it raises."""
        if self.nonfinite_found is None or not bool(self.nonfinite_found):
            return
        flags = list(self._flag_sets.values())
        names = list(dict.fromkeys(self.param_name(p) for params, bad in flags
                                   for p, b in zip(params, bad.tolist()) if b))
        for _, bad in flags:
            bad.zero_()
        self.nonfinite_found.zero_()
        raise NonFiniteGradientError(
            f"parameters {names} had non-finite gradients (NaN or Inf), or gradients or float16 momenta that "
            "overflowed their parameter's dtype, "
            "in a step since the last check; their "
            "update was applied, so restore the last checkpoint, then lower the learning rate or clip gradients"
        )

    def _drop_nonfinite(self, work: list[tuple[dict, list[Tensor]]],
                        refusal: Exception | None = None) -> list[tuple[dict, list[Tensor]]]:
        """Eager: refuse or drop what the verdict finds. ``refusal``: this rank's error from the checks
        before the verdict (then ``work`` has no gradients); raised here, after the verdict has told
        the other ranks, who raise too instead of waiting for this one."""
        params = [p for _, ps in work for p in ps]
        everyone, verdict_groups = self._verdict_scope(refused=refusal is not None)
        if refusal is not None and not verdict_groups:
            raise refusal
        if not params and not verdict_groups:
            return work
        finite, fits, mixed = self._finite(params, [g for g, ps in work for _ in ps], everyone, verdict_groups,
                                           refused=refusal is not None)
        ok = finite & fits
        # One host read of the whole verdict.
        all_ok, any_mixed = torch.stack([ok.all(), mixed.any() if mixed is not None else ok.new_zeros(())]).tolist()
        if any_mixed:
            self._raise_if_mixed(mixed, refusal)
        self._check_grad_placements(params)
        if all_ok:
            return work
        reasons = {  # gradient finite? → (what is wrong, how to fix it)
            False: ("a non-finite gradient (NaN or Inf)", "Lower the learning rate, clip gradients"),
            True: ("a finite gradient, but it or this step's momentum (or AdamW's second moment) would overflow "
                   "float16 (above 65504) and turn the weights into NaN or stop them", "Keep such parameters in "
                   "bfloat16 or float32, scale the loss or gradients down"),
        }

        def reason(p: Tensor, grad_ok: bool) -> tuple[str, str]:
            if grad_ok and p.dtype != torch.float16:  # a float64 gradient beyond the parameter's dtype
                return (f"a finite float64 gradient, but one above the largest {p.dtype} value, which would "
                        "overflow the parameter and its state and turn the weights into NaN",
                        "Keep gradients in the parameter's dtype (p.grad_dtype = p.dtype), scale the loss or "
                        "gradients down")
            return reasons[grad_ok]

        bad = {p: reason(p, grad_ok) for p, grad_ok, step_ok in zip(params, finite.tolist(), ok.tolist())
               if not step_ok}
        for group, ps in work:
            for p in ps:
                if p in bad and group["nonfinite"] == "raise":
                    why, fix = bad[p]
                    what = f"parameter {self.param_name(p)} has {why}; no parameter or state was changed"
                    error = NonFiniteGradientError(f"{what}. {fix}, or pass nonfinite='skip' to skip such updates")
                    error.what = what  # without the advice, for callers that give their own (the CLI)
                    raise error
        for p, (why, _) in bad.items():
            warn_at_caller(
                f"parameter {self.param_name(p)} has {why}; its update was skipped this step")
        return [(g, [p for p in ps if p not in bad]) for g, ps in work]

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _verdict_scope(self, refused: bool = False) -> tuple[list[Tensor], list[dist.ProcessGroup]]:
        """Every parameter of the optimizer, and the groups its step's verdicts are agreed over. A
        rank that refuses its step leaves out what it may have refused (a tensor put into a group by
        hand, one listed twice), so that its table keeps the other ranks' size."""
        everyone = self._all_params()
        if refused:  # each registered tensor once, as every other rank lists them
            everyone = list(dict.fromkeys(p for p in everyone if isinstance(p, Tensor) and p in self._positions))
        return everyone, self._verdict_groups(everyone) if everyone else []

    def _verdict_groups(self, params: list[Tensor]) -> list[dist.ProcessGroup]:
        """Every group over which gradients may differ: the optimizer's meshes, in a fixed order, then,
        where a parameter is also sharded over a mesh dimension none of them covers (e.g. tensor
        parallelism next to FSDP's distributed_mesh), each dimension of that parameter's mesh in
        order. A MAX over each dimension of a mesh in turn is one over the whole mesh; not over the
        whole world, which under pipeline parallelism spans stages whose optimizers hold other
        parameters (their tables differ in size, and the reductions would pair with the wrong ones)."""
        own = [g for g in (self._process_group, self._replicate_group, self._inner_group) if g is not None]
        beyond = [pair for p in params for pair in self._mesh_groups_beyond(p, own)]
        if not beyond:  # every step of most layouts: no rank lists to read
            return own
        groups, seen = list(own), {tuple(dist.get_process_group_ranks(g)) for g in own}
        for ranks, group in beyond:
            if ranks not in seen:
                seen.add(ranks)
                groups.append(group)
        return groups

    def _mesh_groups_beyond(self, p: Tensor, groups: list[dist.ProcessGroup]) -> list[tuple[tuple, Any]]:
        """(ranks, group) of each dimension of ``p``'s mesh if it is sharded beyond the optimizer's
        ``groups``, else nothing; computed once per DTensor parameter."""
        if not isinstance(p, DTensor):
            return []
        if p not in self._beyond_meshes:
            beyond: list[tuple[tuple, Any]] = []
            covered = {tuple(dist.get_process_group_ranks(g)) for g in groups}
            mesh = p.device_mesh
            if any(tuple(dist.get_process_group_ranks(mesh.get_group(dim))) not in covered
                   for dim, placement in enumerate(p.placements) if not isinstance(placement, Replicate)):
                beyond = [(tuple(dist.get_process_group_ranks(mesh.get_group(dim))), mesh.get_group(dim))
                          for dim in range(mesh.ndim)]
            self._beyond_meshes[p] = beyond
        return self._beyond_meshes[p]
