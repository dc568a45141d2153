"""Step-time ratios of two optimizers, from steps taken in turn in one process.

    python benchmarks/paired.py --set d512x4 --threads 1
    python benchmarks/paired.py --set 124m:2 --pairs muon:torch_muon,dion3_f1/4:muon --steps 9 --json out.json

On a shared machine the load drifts within seconds, so two medians measured one after the other
(``benchmarks/ladder.py`` even with ``--rounds``) can differ by 1.5x for the same code. Here the
two optimizers of a pair step in turn (A B, then B A, and so on), each on its own copy of the
same parameters, and the ratio B/A is taken within each pair of adjacent steps: a slow second
slows both sides of one ratio. Reported per pair: both medians, the median of the per-pair ratios
with its interquartile range, and how often B was the slower. Rungs are the ladder's
(``benchmarks/ladder.py``); a rung with its own ``ORTHOPTIM_CPU_DTYPE`` gets it for its own steps.
A benchmark, not a test: quote the ratios of one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from orthoptim.benchmark import gpt_matrix_shapes, make_params, parse_set
from orthoptim.kernels import cpu_dtype
from orthoptim.train.results import write_json

DEFAULT_PAIRS = "muon:torch_muon,dion3_f1/4:muon,adamw:dion3_f1/4"


def _ladder() -> Any:
    """benchmarks/ladder.py as a module (its rung table), loaded by path: benchmarks/ is no package."""
    if "ladder" in sys.modules:
        return sys.modules["ladder"]
    spec = importlib.util.spec_from_file_location("ladder", Path(__file__).with_name("ladder.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["ladder"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th, 50th, 75th) percentiles; all three the value itself for one value."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def paired_times(step_a: Callable[[], Any], step_b: Callable[[], Any], steps: int, warmup: int,
                 device: torch.device) -> tuple[list[float], list[float]]:
    """Milliseconds of ``steps`` steps of each, taken in turn: A B, B A, A B, ... after ``warmup`` each."""
    def timed(step: Callable[[], Any]) -> float:
        if device.type == "cuda":  # nothing queued before (the warm-up's steps) counts in this one
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - start) * 1e3

    for _ in range(warmup):
        step_a()
        step_b()
    a, b = [], []
    for i in range(steps):
        if i % 2 == 0:
            a.append(timed(step_a))
            b.append(timed(step_b))
        else:
            b.append(timed(step_b))
            a.append(timed(step_a))
    return a, b


def measure_pair(ladder: Any, name_a: str, name_b: str, shapes: list[tuple[int, int]], device: torch.device,
                 steps: int, warmup: int) -> dict[str, Any]:
    table = ladder.rungs(device, shapes)
    rung_a, rung_b = table[name_a], table[name_b]

    def stepper(rung: Any) -> Callable[[], Any]:
        opt = rung.make(make_params(shapes, device))

        def step() -> None:
            with ladder.environment_variable(cpu_dtype.ENV_VAR, rung.cpu_dtype):
                opt.step()
        return step

    a, b = paired_times(stepper(rung_a), stepper(rung_b), steps, warmup, device)
    ratios = [tb / ta for ta, tb in zip(a, b)]
    q1, q2, q3 = quartiles(ratios)
    return {"a": name_a, "b": name_b, "a_ms": a, "b_ms": b, "a_median_ms": statistics.median(a),
            "b_median_ms": statistics.median(b), "ratio_median": q2, "ratio_q1": q1, "ratio_q3": q3,
            "b_slower_share": sum(r > 1 for r in ratios) / len(ratios)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default="d512x4", help="GPT matrix set, as in benchmarks/ladder.py")
    ap.add_argument("--pairs", default=DEFAULT_PAIRS, help=f"comma list of A:B rung pairs (default {DEFAULT_PAIRS})")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--steps", type=int, default=9, help="timed steps of each optimizer per pair (default 9)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps of each first (default 1)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    pairs = [p.split(":") for p in args.pairs.split(",") if p]
    if not pairs or any(len(p) != 2 for p in pairs):
        raise SystemExit(f"--pairs={args.pairs!r}: give A:B pairs of rung names, e.g. {DEFAULT_PAIRS}")
    torch.set_num_threads(args.threads)
    label, d_model, layers, _ = parse_set(args.set)
    device = torch.device(args.device)
    shapes = gpt_matrix_shapes(d_model, layers)
    ladder = _ladder()
    known = ladder.rungs(device, shapes)
    unknown = sorted({name for pair in pairs for name in pair if name not in known})
    if unknown:  # before any pair runs
        raise SystemExit(f"--pairs: unknown rung(s) {', '.join(unknown)}; use rungs of benchmarks/ladder.py: "
                         f"{', '.join(known)}")
    results = []
    print(f"paired steps on {label} ({device}, {torch.get_num_threads()} thread(s), "
          f"{'iterations ' + cpu_dtype.describe() + ', ' if device.type == 'cpu' else ''}"
          f"{args.steps} steps each after {args.warmup} warm-up)\n")
    print("| A | B | A median ms | B median ms | B/A (median of pairs) | interquartile | B slower |")
    print("|---|---|---:|---:|---:|---|---:|")
    for name_a, name_b in pairs:
        r = measure_pair(ladder, name_a, name_b, shapes, device, args.steps, args.warmup)
        results.append(r)
        print(f"| {name_a} | {name_b} | {r['a_median_ms']:.1f} | {r['b_median_ms']:.1f} | {r['ratio_median']:.3f} "
              f"| {r['ratio_q1']:.3f}–{r['ratio_q3']:.3f} | {100 * r['b_slower_share']:.0f}% |", flush=True)
    if args.json:
        write_json(args.json, {"set": label, "device": str(device), "threads": torch.get_num_threads(),
                               "cpu_dtype": cpu_dtype.describe() if device.type == "cpu" else None,
                               "torch": torch.__version__, "steps": args.steps, "warmup": args.warmup,
                               "environment": ladder.environment(device, args.threads), "pairs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
