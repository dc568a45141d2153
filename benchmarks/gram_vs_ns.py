"""Gram vs standard Newton-Schulz (Polar Express coefficients): time and distance to the polar factor.

    python benchmarks/gram_vs_ns.py --threads 1 --json results/gram_vs_ns.json

On [8, k, a·k] batches for aspect ratios a = 1 … 16: the median ms of each orthogonalizer and its
relative Frobenius distance to the exact U Vᵀ (float64 SVD) on Gaussian matrices, both in one
``--dtype`` (default float32: equal precision, which is what makes the times comparable; "auto" is
the library's default: bf16 on CPUs with bf16 matrix units, where "gram" runs standard NS, Gram NS
being unstable in bf16). Optimizer step
times, FLOPs, bytes and memory per optimizer are in ``benchmarks/ladder.py`` (this script's step-time
table moved there). A benchmark, not a test: quote medians and ratios from one run.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from orthoptim.benchmark import median, orthogonalization_error, orthogonalizer_callables, time_steps
from orthoptim.train.results import write_json

SHAPES = [(256, 1), (256, 2), (256, 4), (256, 8), (128, 16), (512, 4)]  # (k, aspect): batches [8, k, aspect·k]


def bench_gram(device: str, warmup: int, repeats: int, dtype: torch.dtype | None) -> list[dict]:
    orth = {name: partial(f, dtype=dtype) for name, f in orthogonalizer_callables().items()}
    rows = []
    for k, aspect in SHAPES:
        x = torch.randn(8, k, aspect * k, device=device)
        row = {"shape": [8, k, aspect * k], "aspect": aspect}
        for name in ("polar_express", "gram"):
            f = orth[name]
            row[f"{name}_ms"] = median(time_steps(lambda f=f, x=x: f(x), warmup=warmup, repeats=repeats, device=device))
            row[f"{name}_error"] = orthogonalization_error(f, (k, aspect * k), device=device)
        row["speedup"] = row["polar_express_ms"] / row["gram_ms"]
        rows.append(row)
    return rows


def print_table(rows: list[dict], dtype: str) -> None:
    print(f"Gram vs standard Newton-Schulz (Polar Express, {dtype}, batch 8; error = rel. distance to U Vᵀ)")
    print("| shape | aspect | NS ms | Gram ms | speedup | NS error | Gram error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['aspect']} | {r['polar_express_ms']:.1f} | {r['gram_ms']:.1f} | "
              f"{r['speedup']:.2f} | {r['polar_express_error']:.4f} | {r['gram_error']:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "auto"), default="float32",
                        help="the iterations' dtype, for both (default float32; auto: the library's choice)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    rows = bench_gram(args.device, args.warmup, args.repeats, dtype)
    print_table(rows, args.dtype)
    if args.json:
        write_json(args.json, {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
                               "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
                               "wall_s": time.time() - started, "gram_vs_ns": rows})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
