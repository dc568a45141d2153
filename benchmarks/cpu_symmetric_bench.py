"""CPU micro-benchmark: the blocked symmetric products (``kernels.cpu_symmetric``) against plain bmm.

    python benchmarks/cpu_symmetric_bench.py --threads 1,2 --json results/cpu_symmetric.json

For each dtype (bf16 where the CPU multiplies it natively, and fp32), each thread count and each
side k, times X Xᵀ on [B, k, 4k] and a I + b R + c R² on [B, k, k] with torch.bmm/baddbmm and with
the blocked products at several block sizes, then a whole standard Newton-Schulz (Polar Express, 5
iterations) on [B, k, k] both ways, and X Xᵀ of wide X ([B, k, 2k] and [B, k, 4k]) in blocks of
``select.WIDE_GRAM_BLOCK`` rows. Prints speedups (plain time / blocked time, medians of
``--repeats`` after a warm-up), ``suggested_min_blocked_size``: the smallest k from which the
blocked products at ``cpu_symmetric.BLOCK`` won every product, dtype and thread count measured at
that k and above (the value for ``orthoptim.kernels.select.MIN_BLOCKED_SIZE``), and
``suggested_min_wide_gram_size``: the same for the wide X Xᵀ alone (``select.MIN_BLOCKED_WIDE_GRAM_SIZE``).
A benchmark, not a test: these machines are shared, so compare ratios from one run.
"""

from __future__ import annotations

import argparse
import platform
from datetime import datetime, timezone
from functools import partial

import torch

from orthoptim.benchmark import environment_variable, median, smallest_winning_size, time_steps
from orthoptim.kernels import cpu_dtype, cpu_symmetric, select, torch_backend
from orthoptim.orthogonalize import newton_schulz
from orthoptim.train.results import write_json

SIDES = [256, 384, 512, 768, 1024, 2048]
BLOCKS = [128, 256, 512]


def batch_for(k: int) -> int:
    """Matrices per batch: about 2²² elements of k×k, 1 to 16."""
    return max(1, min(16, (1 << 22) // (k * k)))


def measure(k: int, dtype: torch.dtype, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(k)
    b = batch_for(k)
    x = torch.randn(b, k, 4 * k, generator=gen).to(dtype)
    r = (torch.bmm(x, x.mT) / (4 * k)).to(dtype)
    out = torch.empty(b, k, k, dtype=dtype)

    def ms(fn) -> float:
        return median(time_steps(fn, warmup=1, repeats=repeats))

    row = {"k": k, "batch": b, "dtype": str(dtype).removeprefix("torch."),
           "gram_bmm_ms": ms(lambda: torch.bmm(x, x.mT, out=out)),
           "polynomial_bmm_ms": ms(lambda: torch_backend.symmetric_polynomial(r, 1.0, -0.5, 0.25, out=out)),
           "blocks": {}}
    for block in BLOCKS:
        if block >= k:
            continue
        g = ms(partial(cpu_symmetric.gram, x, out=out, block=block))
        p = ms(partial(cpu_symmetric.symmetric_polynomial, r, 1.0, -0.5, 0.25, out=out, block=block))
        row["blocks"][block] = {"gram_speedup": row["gram_bmm_ms"] / g,
                                "polynomial_speedup": row["polynomial_bmm_ms"] / p}
    row["wide_gram_speedup"] = {}
    for aspect in (select.WIDE_GRAM_ASPECT, 4):
        if aspect == 4 and select.WIDE_GRAM_BLOCK in row["blocks"]:  # x itself: timed above already
            row["wide_gram_speedup"][aspect] = row["blocks"][select.WIDE_GRAM_BLOCK]["gram_speedup"]
            continue
        xa = x[:, :, : aspect * k].contiguous()
        plain = ms(lambda xa=xa: torch.bmm(xa, xa.mT, out=out))
        row["wide_gram_speedup"][aspect] = plain / ms(partial(cpu_symmetric.gram, xa, out=out,
                                                              block=select.WIDE_GRAM_BLOCK))
    square = r[:, :, :k].contiguous()
    plain = ms(lambda: newton_schulz(square, dtype=dtype, symmetric_kernels=False))
    blocked_ns = ms(lambda: _blocked_newton_schulz(square, dtype))
    row["newton_schulz_speedup"] = plain / blocked_ns
    return row


def _blocked_newton_schulz(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with environment_variable(select.ENV_VAR, "blocked"):
        return newton_schulz(x, dtype=dtype, symmetric_kernels=True)


def suggested_min_size(rows: list[dict]) -> int | None:
    """Smallest k from which the default block won every product measured there and above."""
    wins: dict[int, bool] = {}
    for row in rows:
        at = row["blocks"].get(cpu_symmetric.BLOCK)
        won = at is not None and at["gram_speedup"] > 1.0 and at["polynomial_speedup"] > 1.0
        wins[row["k"]] = wins.get(row["k"], True) and won
    return smallest_winning_size(wins)


def suggested_min_wide_gram_size(rows: list[dict]) -> int | None:
    """Smallest k from which the wide X Xᵀ in ``select.WIDE_GRAM_BLOCK`` rows won at every aspect there and above."""
    wins: dict[int, bool] = {}
    for row in rows:
        wins[row["k"]] = wins.get(row["k"], True) and all(s > 1.0 for s in row["wide_gram_speedup"].values())
    return smallest_winning_size(wins)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma list of torch CPU thread counts")
    parser.add_argument("--sides", default=",".join(map(str, SIDES)), help="comma list of k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    dtypes = [torch.float32]
    if cpu_dtype.native_bf16_matmul():
        dtypes.insert(0, torch.bfloat16)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): speedup of the blocked products over bmm (block size: gram / polynomial), "
              "and of a whole standard NS\n")
        print("| dtype | k × n (batch) | " + " | ".join(f"block {b}" for b in BLOCKS) + " | NS, block "
              f"{cpu_symmetric.BLOCK} | X Xᵀ at n = {select.WIDE_GRAM_ASPECT}k / 4k, block {select.WIDE_GRAM_BLOCK} |")
        print("|---|---|" + "---:|" * (len(BLOCKS) + 2))
        for dtype in dtypes:
            for k in [int(s) for s in args.sides.split(",")]:
                row = measure(k, dtype, args.repeats)
                row["threads"] = threads
                rows.append(row)
                cells = [f"{row['blocks'][b]['gram_speedup']:.2f} / {row['blocks'][b]['polynomial_speedup']:.2f}"
                         if b in row["blocks"] else "" for b in BLOCKS]
                wide = " / ".join(f"{s:.2f}" for s in row["wide_gram_speedup"].values())
                print(f"| {row['dtype']} | {k} × {4 * k} ({row['batch']}) | " + " | ".join(cells)
                      + f" | {row['newton_schulz_speedup']:.2f} | {wide} |", flush=True)
    suggestion = suggested_min_size(rows)
    wide_suggestion = suggested_min_wide_gram_size(rows)
    print(f"\nsuggested_min_blocked_size: {suggestion} (block {cpu_symmetric.BLOCK})")
    print(f"suggested_min_wide_gram_size: {wide_suggestion} (block {select.WIDE_GRAM_BLOCK})")
    if args.json:
        write_json(args.json, {
            "benchmark": "cpu_symmetric", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "block": cpu_symmetric.BLOCK, "suggested_min_blocked_size": suggestion,
            "wide_gram_block": select.WIDE_GRAM_BLOCK, "suggested_min_wide_gram_size": wide_suggestion, "rows": rows,
        })


if __name__ == "__main__":
    main()
