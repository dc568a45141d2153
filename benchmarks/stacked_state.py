"""Step time of Dion2/Dion3 with their state stacked per megabatch against the per-matrix ops.

    python benchmarks/stacked_state.py --models 12x16,24x64,4x128 --threads 1 --json out.json

Whole steps of small GPT models (``orthoptim.train.model.GPT``, LAYERSxWIDTH, every parameter with a
fixed gradient), where a step is dispatch-bound: the same optimizer twice in one process, stepping in
turn (``benchmarks/paired.py``'s ``paired_times``), one with batched row selection
(``optim.stacked_state``), one with ``_selection_stacks`` turned off, so that its batches take
the per-matrix ops. Reported: both medians and the median of the per-pair ratios stacked/per-matrix
with its interquartile range. A benchmark, not a test: quote the ratios of one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import orthoptim
from orthoptim.optim import base
from orthoptim.train.model import GPT, GPTConfig
from orthoptim.train.results import write_json

OPTIMIZERS = {"dion3": orthoptim.Dion3, "dion2": orthoptim.Dion2}


def _paired() -> Any:
    """benchmarks/paired.py as a module, loaded by path: benchmarks/ is no package."""
    spec = importlib.util.spec_from_file_location("paired", Path(__file__).with_name("paired.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("paired", module)
    spec.loader.exec_module(module)
    return module


def stepper(name: str, layers: int, width: int, stacked: bool) -> Callable[[], None]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=layers, d_model=width, n_head=4))
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = 0.01 * torch.randn(p.shape, generator=gen)
    opt = OPTIMIZERS[name](orthoptim.param_groups(model), lr=0.01)
    own = base.OrthonormalOptimizer._selection_stacks

    def step() -> None:
        if stacked:
            opt.step()
            return
        base.OrthonormalOptimizer._selection_stacks = lambda *_: None
        try:
            opt.step()
        finally:
            base.OrthonormalOptimizer._selection_stacks = own
    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="12x16,24x64,4x128,12x128", help="comma list of LAYERSxWIDTH")
    ap.add_argument("--optimizers", default="dion3,dion2", help=f"comma list of {', '.join(OPTIMIZERS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--steps", type=int, default=21, help="timed steps of each side (default 21)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first (default 3)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    try:
        models = [tuple(int(v) for v in m.split("x")) for m in args.models.split(",") if m]
    except ValueError:
        raise SystemExit(f"--models={args.models!r}: give LAYERSxWIDTH entries, e.g. 12x16,4x128") from None
    names = [n for n in args.optimizers.split(",") if n]
    if not models or any(len(m) != 2 or min(m) < 1 for m in models) or not names or set(names) - set(OPTIMIZERS):
        raise SystemExit("--models takes LAYERSxWIDTH entries, --optimizers names of " + ", ".join(OPTIMIZERS))
    torch.set_num_threads(args.threads)
    paired = _paired()
    print(f"stacked Dion2/Dion3 state vs per-matrix ops ({torch.get_num_threads()} thread(s), "
          f"{args.steps} steps each after {args.warmup} warm-up)\n")
    print("| model | optimizer | stacked ms | per-matrix ms | stacked / per-matrix | interquartile |")
    print("|---|---|---:|---:|---:|---|")
    rows = []
    for layers, width in models:
        for name in names:
            a, b = paired.paired_times(stepper(name, layers, width, True), stepper(name, layers, width, False),
                                       args.steps, args.warmup, torch.device("cpu"))
            q1, q2, q3 = paired.quartiles([ta / tb for ta, tb in zip(a, b)])
            rows.append({"model": f"{layers}x{width}", "optimizer": name, "stacked_ms": a, "per_matrix_ms": b,
                         "ratio_median": q2, "ratio_q1": q1, "ratio_q3": q3})
            print(f"| {layers}x{width} | {name} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
                  f"{q2:.3f} | {q1:.3f}–{q3:.3f} |", flush=True)
    if args.json:
        write_json(args.json, {"threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
