"""`orthoptim bench`: optimizer step time on GPT-shaped matrices, and orthogonalization accuracy."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from orthoptim.benchmark import (
    PRESETS,
    gpt_matrix_shapes,
    make_params,
    median,
    optimizer_factories,
    orthogonalization_error,
    orthogonalizer_callables,
    time_steps,
)
from orthoptim.cli import HelpFormatter, UsageError, check_out_dir, seed_int
from orthoptim.kernels import cpu_dtype
from orthoptim.train.loop import environment
from orthoptim.train.results import format_table, plot_bench, plots_available, write_json, write_text

DEFAULT_OPTIMIZERS = "adamw,torch_muon,muon,normuon,dion3,dion2,dion_r0.25"

DESCRIPTION = """\
Median time of one optimizer.step() on the matrices of a GPT of the chosen size (q, k, v, o, MLP up
and down of every layer, in nn.Linear layout, gradients fixed), for each optimizer, with its ratio
to torch.optim.AdamW(foreach=True) and to torch.optim.Muon. Each optimizer runs --warmup untimed
steps, then --repeats timed ones; the table reports medians.

Accuracy: the relative Frobenius distance ||orth(A) - UV^T|| / ||UV^T|| between what the optimizer's
orthogonalizer returns and the exact polar factor UV^T (float64 SVD), on Gaussian matrices of the
shapes it orthogonalizes (Dion3/Dion2: the selected `fraction` of rows or columns), worst over
shapes. Dion's rank-r power iteration and AdamW do not approximate a polar factor ('-').

Writes bench.json, bench.png (bar chart) and summary.txt to --out.
"""

EPILOG = """\
examples:
  orthoptim bench                                  # d512 on CPU, 124m on CUDA
  orthoptim bench --model 124m --device cuda --dtype bfloat16
  orthoptim bench --d-model 1024 --layers 8 --optimizers adamw,muon,dion3,dion3_f0.125
"""


def _fraction(name: str) -> float:
    """dion3 → 0.25 (the library default), dion3_f0.5 → 0.5."""
    return float(name.split("_f", 1)[1]) if "_f" in name else 0.25


def accuracy_plan(name: str) -> tuple[Callable[[Tensor], Tensor], Callable[[int, int], tuple[int, int]]] | None:
    """(orthogonalizer, shape it sees for an m×n parameter) of optimizer ``name``, or None."""
    orth = orthogonalizer_callables()
    full: Callable[[int, int], tuple[int, int]] = lambda m, n: (m, n)  # noqa: E731
    if name in ("muon", "normuon"):
        return orth["polar_express"], full
    if name == "muon_gram":
        return orth["gram"], full
    if name.startswith("dion3"):
        f = _fraction(name)
        return orth["gram"], lambda m, n: (math.ceil(f * m), n)  # rows
    if name.startswith("dion2"):
        f = _fraction(name)
        return orth["polar_express"], lambda m, n: (math.ceil(f * m), n) if m <= n else (m, math.ceil(f * n))
    if name == "torch_muon":
        try:
            from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
            from torch.optim._muon import _zeropower_via_newtonschulz as ns
        except ImportError:  # a private function: may move between torch versions
            return None

        def torch_ns(x: Tensor) -> Tensor:
            return torch.stack([ns(m, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS) for m in x])

        return torch_ns, full
    return None


def add_parser(commands: argparse._SubParsersAction) -> None:
    names = sorted(optimizer_factories())
    p = commands.add_parser("bench", help="optimizer step time and orthogonalization accuracy on GPT-shaped matrices",
                            description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter)
    p.set_defaults(run=run)
    p.add_argument("--model", choices=sorted(PRESETS), default=None,
                   help="GPT size preset, as d_model x layers: "
                        + ", ".join(f"{k} = {d}x{n}" for k, (d, n) in PRESETS.items())
                        + " (default: d512 on CPU, 124m on CUDA)")
    p.add_argument("--d-model", type=int, default=None, metavar="N", help="width (with --layers: instead of --model)")
    p.add_argument("--layers", type=int, default=None, metavar="N", help="number of layers (with --d-model)")
    p.add_argument("--mlp-ratio", type=int, default=4, metavar="R", help="MLP hidden width / d_model")
    # torch.optim.Muon (torch_muon) exists from torch 2.9 on; older torch compares without it.
    default = ",".join(n for n in DEFAULT_OPTIMIZERS.split(",") if n in names)
    p.add_argument("--optimizers", default=default, metavar="A,B,...",
                   help=f"comma-separated, from: {', '.join(names)}")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter and state dtype")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="untimed steps per optimizer")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed steps per optimizer (median reported)")
    p.add_argument("--no-accuracy", action="store_true",
                   help="skip the orthogonalization accuracy column (measured on fp32 inputs, whatever --dtype)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice, one per core)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the parameters, gradients and accuracy matrices")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/bench-YYYYmmdd-HHMMSS)")
    p.add_argument("--no-plot", action="store_true", help="do not write bench.png")
    p.add_argument("--quiet", action="store_true", help="no per-optimizer progress lines")


def run(args: argparse.Namespace) -> int:
    factories = optimizer_factories()
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    unknown = [n for n in names if n not in factories]
    if unknown or not names:
        raise UsageError(f"--optimizers: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(sorted(factories))}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"--optimizers names {', '.join(twice)} more than once; each is timed once")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise UsageError(f"--device {args.device!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available to this torch ({torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {args.device}: only cpu and cuda are supported")
    if (args.d_model is None) != (args.layers is None):
        raise UsageError("give --d-model and --layers together (or --model)")
    if args.d_model is not None and args.model is not None:
        raise UsageError("give either --model or --d-model/--layers, not both")
    for flag, value, low in (("--d-model", args.d_model, 1), ("--layers", args.layers, 1),
                             ("--mlp-ratio", args.mlp_ratio, 1), ("--warmup", args.warmup, 0),
                             ("--repeats", args.repeats, 1), ("--threads", args.threads, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag} {value} must be >= {low}")
    if args.d_model is not None:
        d_model, layers, label = args.d_model, args.layers, f"d{args.d_model}x{args.layers}"
    else:
        label = args.model or ("124m" if device.type == "cuda" else "d512")
        d_model, layers = PRESETS[label]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shapes = gpt_matrix_shapes(d_model, layers, args.mlp_ratio)
    out_dir = Path(args.out or time.strftime("runs/bench-%Y%m%d-%H%M%S"))
    check_out_dir(out_dir, create=True)  # before the benchmark, not after it
    say = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"{label}: {len(shapes)} matrices, {sum(a * b for a, b in shapes) / 1e6:.1f} M parameters, {device}, "
        f"{args.dtype}, {args.warmup} warm-up + {args.repeats} timed steps each")

    rows = []
    for name in names:
        params = make_params(shapes, device=device, dtype=dtype, seed=args.seed)
        opt = factories[name](params)
        times = time_steps(opt.step, warmup=args.warmup, repeats=args.repeats, device=device)
        state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if isinstance(v, Tensor))
        row = {"optimizer": name, "median_ms": median(times), "times_ms": times, "state_mb": state_bytes / 2**20}
        if not args.no_accuracy:
            row.update(_accuracy(name, shapes, device, args.seed))
        rows.append(row)
        err = row.get("orth_error")
        say(f"  {name:<14} {row['median_ms']:10.2f} ms" + (f"   orth error {err:.2e}" if err is not None else ""))
        del opt, params
    ref = {r["optimizer"]: r["median_ms"] for r in rows}
    for r in rows:
        r["vs_adamw"] = r["median_ms"] / ref["adamw"] if "adamw" in ref else None
        r["vs_torch_muon"] = r["median_ms"] / ref["torch_muon"] if "torch_muon" in ref else None

    table = bench_table(rows, args.no_accuracy)
    if device.type == "cpu":  # the iterations' dtype decides the times as much as the optimizer does
        table += (f"\nNewton-Schulz iterations on this CPU: orthoptim in {cpu_dtype.iteration_dtype_name()} "
                  f"(ORTHOPTIM_CPU_DTYPE: {cpu_dtype.describe()}), torch.optim.Muon in bfloat16")
    results = {"model": label, "d_model": d_model, "layers": layers, "mlp_ratio": args.mlp_ratio,
               "shapes": sorted({tuple(s) for s in shapes}), "parameters": sum(a * b for a, b in shapes),
               "device": str(device), "dtype": args.dtype, "warmup": args.warmup, "repeats": args.repeats,
               "environment": environment(str(device)), "rows": rows}
    write_json(out_dir / "bench.json", results)
    write_text(out_dir / "summary.txt", table + "\n")
    plot = not args.no_plot and plots_available()
    if plot:
        plot_bench(rows, out_dir / "bench.png", f"optimizer.step(), {label} matrices "
                   f"({results['parameters'] / 1e6:.1f} M params), {device}, {args.dtype}")
    print(table)
    print(f"\nResults: {out_dir / 'bench.json'}" + (f", plot: {out_dir / 'bench.png'}" if plot else ""))
    return 0


def _accuracy(name: str, shapes: list[tuple[int, int]], device: torch.device, seed: int) -> dict:
    plan = accuracy_plan(name)
    if plan is None:
        return {"orth_error": None, "orth_error_by_shape": {}}
    orthogonalize, seen = plan
    by_shape = {}
    for m, n in sorted(set(shapes)):
        k = seen(m, n)
        by_shape[f"{k[0]}x{k[1]}"] = orthogonalization_error(orthogonalize, k, device=str(device), seed=seed)
    return {"orth_error": max(by_shape.values()), "orth_error_by_shape": by_shape}


def bench_table(rows: list[dict], no_accuracy: bool) -> str:
    head = ["optimizer", "median ms", "vs AdamW", "vs torch Muon", "state MB"] + ([] if no_accuracy else ["orth error"])
    body = []
    for r in rows:
        cells = [r["optimizer"], f"{r['median_ms']:.2f}",
                 f"{r['vs_adamw']:.2f}x" if r["vs_adamw"] is not None else "-",
                 f"{r['vs_torch_muon']:.2f}x" if r["vs_torch_muon"] is not None else "-",
                 f"{r['state_mb']:.1f}"]
        if not no_accuracy:
            cells.append(f"{r['orth_error']:.2e}" if r.get("orth_error") is not None else "-")
        body.append(cells)
    note = ("orth error: ||orth(A) - polar(A)||_F / ||polar(A)||_F on Gaussian fp32 A (whatever --dtype) of the "
            "shapes the optimizer orthogonalizes, worst shape")
    return format_table(head, body) + ("" if no_accuracy else "\n" + note)
