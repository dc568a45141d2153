"""A user's orthogonalizer (any callable) with its outputs checked: a wrong shape would broadcast into
the update and NaNs would reach the parameters, both silently. A failing batch gets a zero update,
and the step then raises on every rank together.

``CheckedOrthogonalizers`` is a part of ``OrthonormalOptimizer`` (``optim/base.py``); it reads the
optimizer's ``capturable`` and its verdict scope (``GradientChecks._verdict_scope``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.distributed.dtensor import local_tensor
from orthoptim.optim.capture import capturing
from orthoptim.orthogonalize import Orthogonalizer, PolarFactors


def users_own(spec: Any) -> bool:
    """Whether a group's orthogonalizer is a callable of the user's, not a name or this library's own
    function (e.g. ``svd_polar``, or a partial of one): only those have their outputs checked, since a
    check reads the output back on the host (it would stall a GPU step)."""
    if not callable(spec):
        return False
    while isinstance(spec, partial):
        spec = spec.func
    return getattr(spec, "__module__", "").split(".")[0] != "orthoptim"


class CheckedOrthogonalizers:
    """Wraps a user's orthogonalizer so that its failures are collected during the step and raised after it."""

    def _init_orthogonalizer_checks(self) -> None:
        self._orthogonalizer_problems: list[str] = []  # what a user's orthogonalizer did wrong this step
        self._orthogonalizer_error: Exception | None = None  # the first exception it raised, for the chain

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
            if self._orthogonalizer_error is None:
                self._orthogonalizer_error = e
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
        cause, self._orthogonalizer_error = self._orthogonalizer_error, None
        failed = bool(problems)
        # While a CUDA graph is captured nothing is read back: only this rank's problems (wrong shapes,
        # seen on the host) are raised then; the eager steps before a capture agree across ranks.
        everyone, verdict_groups = self._verdict_scope() if not capturing() else ([], [])
        if verdict_groups:
            flag = torch.zeros(1, dtype=torch.uint8, device=local_tensor(everyone[0]).device).fill_(int(failed))
            for group in verdict_groups:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            failed = bool(flag.item())
        if failed:
            what = "; ".join(problems) if problems else "the orthogonalizer failed on another rank (see its error)"
            raise ValueError(
                f"{what}. Those matrices got a zero update this step (only their weight decay; nothing "
                "non-finite reached the weights), but momenta and the other parameters were updated: fix the "
                "orthogonalizer, then restore the optimizer and model from a checkpoint") from cause
