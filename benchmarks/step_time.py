"""Median ms per optimizer.step() on GPT-shaped matrix sets, and Gram vs standard Newton-Schulz.

    python benchmarks/step_time.py                      # d512 and d1024 (4 layers), CPU
    python benchmarks/step_time.py --sets 124m --repeats 3 --json out.json

Prints tables with ratios to this library's Muon and to torch.optim.AdamW(foreach=True) (the
memory-bound floor) and writes JSON. A benchmark, not a test: rerun on a quiet machine and quote
medians and ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

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

DEFAULT_OPTIMIZERS = "adamw,torch_muon,muon,muon_gram,normuon,dion3,dion3_f0.5,dion3_f0.125,dion2,dion_r0.25"


def bench_set(name: str, optimizers: list[str], device: str, warmup: int, repeats: int) -> list[dict]:
    d_model, layers = PRESETS[name]
    shapes = gpt_matrix_shapes(d_model, layers)
    factories = optimizer_factories()
    rows = []
    for opt_name in optimizers:
        params = make_params(shapes, device=device)
        opt = factories[opt_name](params)
        times = time_steps(opt.step, warmup=warmup, repeats=repeats, device=device)
        rows.append({"set": name, "optimizer": opt_name, "median_ms": median(times), "times_ms": times,
                     "matrices": len(shapes), "parameters": sum(a * b for a, b in shapes)})
        print(f"  {name:>6} {opt_name:<14} {median(times):9.1f} ms", flush=True)
        del opt, params
    ref = {r["optimizer"]: r["median_ms"] for r in rows}
    for r in rows:
        r["vs_muon"] = r["median_ms"] / ref["muon"] if "muon" in ref else None
        r["vs_adamw"] = r["median_ms"] / ref["adamw"] if "adamw" in ref else None
    return rows


def bench_gram(device: str, warmup: int, repeats: int) -> list[dict]:
    """Standard vs Gram Newton-Schulz (Polar Express coefficients) on [8, k, a·k] batches."""
    orth = orthogonalizer_callables()
    rows = []
    for k, aspect in [(256, 1), (256, 2), (256, 4), (256, 8), (128, 16), (512, 4)]:
        x = torch.randn(8, k, aspect * k, device=device)
        row = {"shape": [8, k, aspect * k], "aspect": aspect}
        for name in ("polar_express", "gram"):
            f = orth[name]
            row[f"{name}_ms"] = median(time_steps(lambda f=f, x=x: f(x), warmup=warmup, repeats=repeats, device=device))
            row[f"{name}_error"] = orthogonalization_error(f, (k, aspect * k), device=device)
        row["speedup"] = row["polar_express_ms"] / row["gram_ms"]
        rows.append(row)
        print(f"  gram {row['shape']}: NS {row['polar_express_ms']:.1f} ms, Gram {row['gram_ms']:.1f} ms, "
              f"x{row['speedup']:.2f}", flush=True)
    return rows


def print_tables(step_rows: list[dict], gram_rows: list[dict]) -> None:
    print("\noptimizer.step() on GPT-shaped matrix sets (median ms)")
    print(f"{'set':>6}  {'optimizer':<14} {'median ms':>10} {'vs muon':>8} {'vs adamw':>9}")
    for r in step_rows:
        vm = f"{r['vs_muon']:.3f}" if r["vs_muon"] is not None else "-"
        va = f"{r['vs_adamw']:.2f}" if r["vs_adamw"] is not None else "-"
        print(f"{r['set']:>6}  {r['optimizer']:<14} {r['median_ms']:>10.1f} {vm:>8} {va:>9}")
    if gram_rows:
        print("\nGram vs standard Newton-Schulz (Polar Express, batch 8; error = rel. distance to U Vᵀ)")
        print(f"{'shape':>16} {'aspect':>6} {'NS ms':>8} {'Gram ms':>8} {'speedup':>8} {'NS err':>8} {'Gram err':>8}")
        for r in gram_rows:
            print(f"{r['shape']!s:>16} {r['aspect']:>6} {r['polar_express_ms']:>8.1f} {r['gram_ms']:>8.1f} "
                  f"{r['speedup']:>8.2f} {r['polar_express_error']:>8.4f} {r['gram_error']:>8.4f}")


def write_json(path: str, payload: dict) -> None:
    """Atomic write: a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="d512,d1024", help=f"comma list from {sorted(PRESETS)}")
    parser.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS, help="comma list of optimizer names")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-gram", action="store_true", help="skip the Gram vs standard NS table")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default="results/step_time.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    optimizers = args.optimizers.split(",")
    unknown = set(optimizers) - set(optimizer_factories())
    if unknown:
        parser.error(f"unknown optimizers {sorted(unknown)}; known: {sorted(optimizer_factories())}")
    started = time.time()
    step_rows = []
    for name in args.sets.split(","):
        if name not in PRESETS:
            parser.error(f"unknown set {name!r}; known: {sorted(PRESETS)}")
        step_rows += bench_set(name, optimizers, args.device, args.warmup, args.repeats)
    gram_rows = [] if args.no_gram else bench_gram(args.device, args.warmup, args.repeats)
    print_tables(step_rows, gram_rows)
    write_json(args.json, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device, "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
        "wall_s": time.time() - started, "steps": step_rows, "gram_vs_ns": gram_rows,
    })
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
