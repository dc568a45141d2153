"""Kernel micro-benchmark on a CUDA device: torch vs Triton for each product, and whole orthogonalizers.

    python benchmarks/kernels_bench.py --out results/kernels_bench.json [--budget-s 240]

Sections, in order (later ones are skipped, and marked so, once the time budget is spent):

1. ``dion3_update``: the fused post-orthogonalization update vs the torch reference vs the unfused
   path the rule used before (normalize → decay → index_add).
2. ``gram``: X Xᵀ on [B, k, n] — torch.bmm vs the lower-triangle Triton kernel; then
   ``symmetric_polynomial`` / ``symmetric_product``: the k×k products of Gram NS, k = 128 … 4096.
3. ``orthogonalize``: standard NS (bf16) vs Gram NS with the torch backend vs Gram NS with the
   Triton kernels (fp16), Polar Express coefficients, and each one's distance to standard NS.

Every time is the median of CUDA-event timings after warm-up (the first call of each shape also
autotunes the Triton kernel, outside the timing). Without CUDA or triton it writes a JSON that says
so and exits 0. ``suggested_min_triton_size`` is the smallest k from which Triton won every product
measured at that k and above: the value to put in ``orthoptim.kernels.select.MIN_TRITON_SIZE``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial

import torch

from orthoptim import kernels
from orthoptim.benchmark import smallest_winning_size
from orthoptim.kernels import torch_backend
from orthoptim.orthogonalize import POLAR_EXPRESS, gram_newton_schulz, newton_schulz

GRAM_SHAPES = [(64, 128, 512), (32, 256, 1024), (16, 512, 2048), (8, 1024, 4096), (4, 2048, 8192), (2, 4096, 11008)]
SQUARE_SIZES = [128, 256, 512, 1024, 2048, 4096]
SQUARE_BATCH_CAP = 64  # batch of k×k matrices: 2²⁴ / k² elements, at most this many
# [B, k, n] batches an orthogonalizer sees: Dion3 rows at 1/4 of 1B/7B-like matrices, Muon's short side.
ORTH_SHAPES = [(16, 512, 2048), (16, 1024, 4096), (8, 2048, 8192), (4, 4096, 11008)]
# (batch, m, n, k): megabatches of bf16 parameters with the rows Dion3 selects at 1/4.
DION3_SHAPES = [(24, 2048, 2048, 512), (16, 8192, 2048, 2048), (8, 4096, 11008, 1024)]


DEVICE = "cuda"


def cuda_median_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median of ``reps`` CUDA-event timings of ``fn`` after ``warmup`` calls (wall clock for --smoke)."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-300))


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.deadline


class Recorder:
    """The report's rows, with the JSON rewritten after each one: a stop (gpu_check.sh's timeout sends
    SIGINT) in the middle of a section keeps every row measured before it."""

    def __init__(self, report: dict, path: str) -> None:
        self.report, self.path, self.started = report, path, time.monotonic()
        self.rows: list[dict] = report.setdefault("results", [])

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()

    def save(self) -> None:
        self.report["suggested_min_triton_size"] = suggest_min_size(self.rows)
        self.report["seconds"] = time.monotonic() - self.started
        write_report(self.report, self.path)


def bench_products(tsym, budget: Budget, warmup: int, reps: int, rows: Recorder) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for b, k, n in GRAM_SHAPES:
            if not budget.left():
                rows.add({"op": "gram", "shape": [b, k, n], "dtype": str(dtype), "skipped": "budget"})
                continue
            x = (torch.randn(b, k, n, device=DEVICE, generator=gen) / n**0.5).to(dtype)
            rows.add(_gram_case(tsym, x, warmup, reps))
        for k in SQUARE_SIZES:
            b = max(1, min(SQUARE_BATCH_CAP, 2**24 // (k * k)))
            if not budget.left():
                for op in ("symmetric_polynomial", "symmetric_product"):
                    rows.add({"op": op, "shape": [b, k, k], "dtype": str(dtype), "skipped": "budget"})
                continue
            x = torch.randn(b, k, 2 * k, device=DEVICE, generator=gen) / (2 * k) ** 0.5
            for row in _square_cases(tsym, torch.bmm(x, x.mT).to(dtype), warmup, reps):
                rows.add(row)


def _gram_case(tsym, x: torch.Tensor, warmup: int, reps: int) -> dict:
    err = rel_err(tsym.gram(x), torch_backend.gram(x.float()))
    return _pair("gram", x, lambda: torch_backend.gram(x), lambda: tsym.gram(x), err, warmup, reps)


def _square_cases(tsym, r: torch.Tensor, warmup: int, reps: int) -> list[dict]:
    a, b, c = POLAR_EXPRESS[1]
    p = torch_backend.symmetric_polynomial(r, a, b, c)
    err_poly = rel_err(tsym.symmetric_polynomial(r, a, b, c), torch_backend.symmetric_polynomial(r.float(), a, b, c))
    err_prod = rel_err(tsym.symmetric_product(r, p), torch.bmm(r.float(), p.float()))
    return [
        _pair("symmetric_polynomial", r, lambda: torch_backend.symmetric_polynomial(r, a, b, c),
              lambda: tsym.symmetric_polynomial(r, a, b, c), err_poly, warmup, reps),
        _pair("symmetric_product", r, lambda: torch_backend.symmetric_product(r, p),
              lambda: tsym.symmetric_product(r, p), err_prod, warmup, reps),
    ]  # fmt: skip


def _pair(op, x, torch_fn, triton_fn, err, warmup, reps) -> dict:
    shape, dtype = list(x.shape), x.dtype
    t_torch = cuda_median_ms(torch_fn, warmup, reps)
    t_triton = cuda_median_ms(triton_fn, warmup, reps)
    row = {"op": op, "shape": shape, "dtype": str(dtype), "torch_ms": t_torch, "triton_ms": t_triton,
           "speedup": t_torch / t_triton, "rel_err_vs_fp32_torch": err}  # fmt: skip
    print(f"  {op:<22} {dtype!s:<15} {shape!s:<20} torch {t_torch:8.3f} ms  triton {t_triton:8.3f} ms"
          f"  x{t_torch / t_triton:5.2f}  err {err:.1e}", flush=True)  # fmt: skip
    return row


def bench_orthogonalize(budget: Budget, warmup: int, reps: int, rows: Recorder) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for b, k, n in ORTH_SHAPES:
        if not budget.left():
            rows.add({"op": "orthogonalize", "shape": [b, k, n], "skipped": "budget"})
            continue
        rows.add(_orthogonalize_case(torch.randn(b, k, n, device=DEVICE, generator=gen).to(torch.bfloat16),
                                     warmup, reps))  # fmt: skip


def _orthogonalize_case(x: torch.Tensor, warmup: int, reps: int) -> dict:
    ns = partial(newton_schulz, coefficients=POLAR_EXPRESS)
    gram = partial(gram_newton_schulz, coefficients=POLAR_EXPRESS)
    times, outs = {}, {}
    for name, fn, env in [("ns_bf16", ns, "torch"), ("gram_torch_fp16", gram, "torch"),
                          ("gram_triton_fp16", gram, "triton")]:  # fmt: skip
        os.environ[kernels.ENV_VAR] = env
        outs[name] = fn(x)
        times[name] = cuda_median_ms(partial(fn, x), warmup, reps)
    os.environ.pop(kernels.ENV_VAR, None)
    row = {"op": "orthogonalize", "shape": list(x.shape), "input_dtype": "bf16",
           **{f"{name}_ms": t for name, t in times.items()},
           "speedup_gram_triton_vs_ns": times["ns_bf16"] / times["gram_triton_fp16"],
           "speedup_gram_torch_vs_ns": times["ns_bf16"] / times["gram_torch_fp16"],
           "rel_diff_gram_triton_vs_ns": rel_err(outs["gram_triton_fp16"], outs["ns_bf16"]),
           "rel_diff_gram_torch_vs_ns": rel_err(outs["gram_torch_fp16"], outs["ns_bf16"])}  # fmt: skip
    print(f"  orthogonalize {list(x.shape)!s:<20} NS {times['ns_bf16']:8.3f}"
          f"  gram/torch {times['gram_torch_fp16']:8.3f}  gram/triton {times['gram_triton_fp16']:8.3f} ms"
          f"  x{row['speedup_gram_triton_vs_ns']:.2f} vs NS  diff {row['rel_diff_gram_triton_vs_ns']:.1e}",
          flush=True)  # fmt: skip
    return row


DION3_HYPER = {"lr": 0.02, "weight_decay": 0.1, "scale": 1.0, "beta2": 0.95, "eps": 1e-8}


def bench_dion3(tdion3, budget: Budget, warmup: int, reps: int, rows: Recorder) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    for b, m, n, k in DION3_SHAPES:
        if not budget.left():
            rows.add({"op": "dion3_update", "shape": [b, m, n, k], "skipped": "budget"})
            continue
        params = [(0.02 * torch.randn(m, n, device=DEVICE, generator=gen)).to(torch.bfloat16) for _ in range(b)]
        index = torch.stack([torch.randperm(m, device=DEVICE, generator=gen)[:k] for _ in range(b)])
        o = (torch.randn(b, k, n, device=DEVICE, generator=gen) / n**0.5).to(torch.bfloat16)
        v = torch.rand(b, k, device=DEVICE, generator=gen) / n
        rows.add(_dion3_case(tdion3, params, index, o, v, warmup, reps))


def _dion3_case(tdion3, params, index, o, v, warmup: int, reps: int) -> dict:
    from orthoptim.rules import normalization, selection, weight_decay

    hyper = DION3_HYPER

    def unfused():  # the rule's path before the fused update: three passes, Ô rounded to bf16
        o_hat, _ = normalization.normalize_rows(o, v, hyper["beta2"], hyper["eps"])
        weight_decay.decay_(params, hyper["lr"], hyper["weight_decay"])
        selection.add_slices_(params, index, o_hat.to(o.dtype), 0, alpha=-hyper["lr"] * hyper["scale"])

    times = {
        "unfused_ms": cuda_median_ms(unfused, warmup, reps),
        "torch_reference_ms": cuda_median_ms(
            lambda: torch_backend.dion3_post_update(params, index, o, v, **hyper), warmup, reps),
        "triton_ms": cuda_median_ms(lambda: tdion3.dion3_post_update(params, index, o, v, **hyper), warmup, reps),
    }  # fmt: skip
    # Accuracy on fresh copies: the fused kernel against the torch reference (both round once).
    a = [p.clone() for p in params]
    c = [p.clone() for p in params]
    tdion3.dion3_post_update(a, index, o, v, **hyper)
    torch_backend.dion3_post_update(c, index, o, v, **hyper)
    mismatch = sum(int((x != y).sum()) for x, y in zip(a, c)) / sum(x.numel() for x in a)
    (b, k, n), m = o.shape, params[0].shape[0]
    bytes_min = b * m * n * 2 * 2 + b * k * n * 2  # read + write X once, read O once
    row = {"op": "dion3_update", "shape": [b, m, n, k], "param_dtype": "bf16", **times,
           "speedup_vs_unfused": times["unfused_ms"] / times["triton_ms"],
           "triton_GBps": bytes_min / times["triton_ms"] / 1e6,
           "fraction_elements_differing_from_torch_reference": mismatch}  # fmt: skip
    print(f"  dion3_update {[b, m, n, k]!s:<24} unfused {times['unfused_ms']:8.3f}  torch-ref "
          f"{times['torch_reference_ms']:8.3f}  triton {times['triton_ms']:8.3f} ms  "
          f"({row['triton_GBps']:.0f} GB/s)  differing {mismatch:.1e}", flush=True)  # fmt: skip
    return row


def suggest_min_size(rows: list[dict]) -> int | None:
    """Smallest k such that Triton won every symmetric k×k product at k and above."""
    wins: dict[int, bool] = {}
    for r in rows:
        if r.get("op") in ("symmetric_polynomial", "symmetric_product", "gram") and "speedup" in r:
            k = r["shape"][1]
            wins[k] = wins.get(k, True) and r["speedup"] > 1.0
    return smallest_winning_size(wins)


def _use_smoke_settings() -> None:
    global DEVICE, GRAM_SHAPES, SQUARE_SIZES, SQUARE_BATCH_CAP, ORTH_SHAPES, DION3_SHAPES
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
    DEVICE = "cpu"
    GRAM_SHAPES, SQUARE_SIZES, SQUARE_BATCH_CAP = [(2, 20, 40)], [24], 2
    ORTH_SHAPES, DION3_SHAPES = [(2, 20, 40)], [(2, 30, 40, 8)]


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting new cases after this long")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU through Triton's interpreter: checks this script, times nothing")
    args = parser.parse_args()
    if args.smoke:
        _use_smoke_settings()

    report: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        report["skipped"] = "triton is not installed"
    if not torch.cuda.is_available() and not args.smoke:
        report["skipped"] = "no CUDA device"
    if "skipped" in report:
        print(f"kernels_bench: {report['skipped']}; nothing measured")
    else:
        from orthoptim.kernels import triton_dion3, triton_symmetric

        report["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run, interpreter)"
        report["min_triton_size_in_use"] = kernels.MIN_TRITON_SIZE
        budget = Budget(args.budget_s)
        rows = Recorder(report, args.out)
        # Cheapest first; the JSON is rewritten after each row, and a section that breaks is recorded
        # and skipped, so an error, or a stop (SIGINT) in the middle of a section, keeps what was measured.
        sections = [("dion3", lambda: bench_dion3(triton_dion3, budget, args.warmup, args.reps, rows)),
                    ("products", lambda: bench_products(triton_symmetric, budget, args.warmup, args.reps, rows)),
                    ("orthogonalize", lambda: bench_orthogonalize(budget, args.warmup, args.reps, rows))]
        for name, run in sections:
            try:
                run()
            except KeyboardInterrupt:
                report["stopped"] = f"interrupted during the {name} section"
                rows.save()
                print(f"kernels_bench: {report['stopped']}; {args.out} keeps the rows measured", flush=True)
                sys.exit(130)
            except Exception as e:
                traceback.print_exc()
                report.setdefault("failed", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.save()
        print(f"suggested MIN_TRITON_SIZE: {report['suggested_min_triton_size']} "
              f"(in use: {kernels.MIN_TRITON_SIZE}); {report['seconds']:.0f} s")  # fmt: skip
    write_report(report, args.out)
    if "failed" in report:
        sys.exit(1)


def write_report(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
