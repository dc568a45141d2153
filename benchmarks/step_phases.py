"""Where one optimizer step spends its time: the step's phases timed inside real steps.

    python benchmarks/step_phases.py --optimizer dion3 --set d512 --threads 1
    python benchmarks/step_phases.py --optimizer muon --set 124m:2 --json results/phases.json

Wraps the functions a step is made of (the rule helpers in ``orthoptim.rules``, the post-update
in ``orthoptim.kernels``, the orthogonalizer of each megabatch shape and the non-finite check)
with timers, runs ``--warmup`` untimed and ``--repeats`` timed steps on the GPT-shaped matrices of
``--set`` (as in ``benchmarks/ladder.py``), and prints each phase's median ms per step, its share
of the median step, and what no wrapped phase accounts for (Python, grouping, views). On a GPU
the timers synchronize, so the phases add up but the step runs slower than unwrapped. A
benchmark, not a test: quote medians and shares from one run.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from orthoptim import kernels
from orthoptim.benchmark import gpt_matrix_shapes, make_params, median, optimizer_factories, parse_set
from orthoptim.kernels import cpu_dtype
from orthoptim.optim import base, nonfinite
from orthoptim.rules import momentum, selection, weight_decay
from orthoptim.train.results import write_json

# (module, function, phase): what the matrix rules call, by module attribute, so wrapping it here
# times every call a step makes.
PHASES = [
    (momentum, "accumulate_", "momentum M ← μM + G"),
    (momentum, "accumulate_and_stack", "momentum + stack (Muon)"),
    (selection, "top_slices", "row L1 norms + top-k"),
    (selection, "accumulate_and_row_norms_", "momentum M ← M + G + row L1 norms (Dion3)"),
    (selection, "accumulate_and_l1_norms_stacked_", "momentum M ← M + G + L1 norms (stacked state)"),
    (selection, "gather_slices", "gather selected rows"),
    (selection, "gather_stacked", "gather selected rows"),
    (selection, "decay_slices_", "error-feedback decay"),
    (selection, "decay_stacked_", "error-feedback decay"),
    (selection, "gather_entries", "gather row variances"),
    (selection, "scatter_entries_", "scatter row variances"),
    (selection, "add_slices_", "update selected slices (Dion2)"),
    (kernels, "dion3_post_update", "normalize + decay + update (Dion3)"),
    (weight_decay, "decay_", "weight decay"),
    (weight_decay, "apply_", "apply update"),
    (weight_decay, "decay_and_apply_", "decay + update"),
    (weight_decay, "apply_polar_factors_", "last product + decay + update (Muon)"),
    (nonfinite.GradientChecks, "_finite", "non-finite check"),
]


@contextmanager
def timed_phases(device: torch.device) -> Iterator[dict[str, float]]:
    """Seconds per phase, accumulated over every call while the context is open."""
    spent: dict[str, float] = defaultdict(float)
    saved: list[tuple[Any, str, Any]] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    depth = [0]  # a phase called inside another (decay_ inside Muon's update) counts for the outer one

    def timer(fn: Callable[..., Any], label: Callable[..., str]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return fn(*args, **kwargs)
            sync()
            start = time.perf_counter()
            depth[0] += 1
            try:
                out = fn(*args, **kwargs)
            finally:
                depth[0] -= 1
            sync()
            spent[label(*args)] += time.perf_counter() - start
            return out
        return run

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, value)

    for owner, name, phase in PHASES:
        if name not in owner.__dict__:
            continue
        fn = getattr(owner, name)
        patch(owner, name, timer(fn, lambda *_, phase=phase: phase))
    # The orthogonalizers, by the shape of the batch they get (a factored one's product lands in
    # the Muon update, timed there).
    get_orth, get_factored = base.OrthonormalOptimizer._orthogonalizer, base.get_factored_orthogonalizer

    def orth_phase(x: Any, *_: Any) -> str:
        return f"orthogonalize {list(x.shape)}"

    patch(base.OrthonormalOptimizer, "_orthogonalizer",
          staticmethod(lambda group: timer(get_orth(group), orth_phase)))
    patch(base, "get_factored_orthogonalizer",
          lambda spec: None if (f := get_factored(spec)) is None else timer(f, orth_phase))
    try:
        yield spent
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def measure(name: str, shapes: list[tuple[int, int]], device: torch.device, warmup: int,
            repeats: int) -> dict[str, Any]:
    params = make_params(shapes, device=device)
    opt = optimizer_factories()[name](params)
    for _ in range(warmup):
        opt.step()
    if device.type == "cuda":  # the warm-up's queued work is not the first timed step's
        torch.cuda.synchronize(device)
    steps: list[float] = []
    per_phase: dict[str, list[float]] = defaultdict(list)
    with timed_phases(device) as spent:
        for _ in range(repeats):
            spent.clear()
            start = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            steps.append((time.perf_counter() - start) * 1e3)
            for phase, seconds in spent.items():
                per_phase[phase].append(seconds * 1e3)
    step_ms = median(steps)
    phases = {phase: median(ms) for phase, ms in per_phase.items()}
    rows = [{"phase": p, "median_ms": ms, "share": ms / step_ms} for p, ms in sorted(phases.items(),
                                                                                       key=lambda kv: -kv[1])]
    # Medians of parts need not add up to the median step: the rest is the median step minus them.
    rest = step_ms - sum(phases.values())
    rows.append({"phase": "not in any phase (Python, grouping, views)", "median_ms": rest, "share": rest / step_ms})
    return {"optimizer": name, "median_step_ms": step_ms, "step_ms": steps, "phases": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="dion3", choices=[n for n in optimizer_factories() if n != "adamw"
                                                             and not n.startswith("torch")])
    ap.add_argument("--set", default="d512", help="GPT matrix set, as in benchmarks/ladder.py (e.g. d512, 124m:2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    label, d_model, layers, _ = parse_set(args.set)
    device = torch.device(args.device)
    result = measure(args.optimizer, gpt_matrix_shapes(d_model, layers), device, args.warmup, args.repeats)
    result.update({"set": label, "device": str(device), "threads": torch.get_num_threads(),
                   "cpu_dtype": cpu_dtype.describe() if device.type == "cpu" else None, "torch": torch.__version__})
    print(f"{args.optimizer} on {label} ({device}, {torch.get_num_threads()} threads"
          f"{', iterations ' + result['cpu_dtype'] if result['cpu_dtype'] else ''}): "
          f"median step {result['median_step_ms']:.1f} ms over {args.repeats} steps\n")
    print("| phase | median ms | share of step |\n|---|---:|---:|")
    for row in result["phases"]:
        print(f"| {row['phase']} | {row['median_ms']:.1f} | {100 * row['share']:.0f}% |")
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
