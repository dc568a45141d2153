"""The benchmark ladder: what one optimizer step costs on GPT-shaped matrix sets, rung by rung.

    python benchmarks/ladder.py                                  # CPU: 124m:4, 1 thread (~3 min on one AVX2 core)
    python benchmarks/ladder.py --sets 124m,1b:1 --json results/ladder.json --png results/ladder.png
    python benchmarks/ladder.py --device cuda --sets 124m,1b,7b:8 --json out/ladder.json

Rungs: AdamW (torch, foreach and fused: the memory floor), Muon with standard Newton-Schulz as
the library runs it by default (on CPUs its symmetric products blocked from k = 768 on), with
every product a plain bmm (``muon_bmm``), + symmetric kernels everywhere, + Gram NS, Dion3 at
fraction 1/2, 1/4, 1/8, Dion at rank 1/4, and torch.optim.Muon as an outside reference.
Sets: the matrices of a GPT (q, k, v, o, MLP up and down per layer, nn.Linear layout) from
``orthoptim.benchmark.PRESETS``; ``NAME:L`` keeps the widths and takes L layers (a step's time,
FLOPs, bytes and state grow linearly with L; the time ratios, passes and state ratio do not change;
the transient memory does not grow with L: the step orthogonalizes a big megabatch in up to four
parts, so its ratio to the megabatch falls as L grows, e.g. Muon 3.5x at d512:1, 0.88x at d512:4).
7b is GPU-only.

Per rung: median ms of --repeats timed steps after --warmup untimed ones; ratios to muon, to
adamw (foreach) and to adamw_fused; then from one more, untimed step under the counters of
``orthoptim.benchmark_counts``: matmul GFLOP/step, GB moved/step (each op charged its inputs and
outputs once: an upper-bound traffic model), passes over parameter memory (bytes moved / bytes of
the parameters; "ew" leaves out the matrix products), optimizer state bytes (× parameter bytes),
peak transient bytes of the step beyond parameters, gradients and state (× the largest megabatch,
the biggest group of same-shape matrices), and achieved GFLOP/s and GB/s. The device's own matmul
and copy rates, measured at start, are printed to set them against. Single process: no
communication (benchmarks/comm_table.py counts collectives on real ranks).

Writes a markdown table (stdout), the ops that move the most bytes per rung, --json (rewritten
after every rung, so a killed run keeps what it measured) and --png (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import orthoptim
from orthoptim import kernels
from orthoptim.benchmark import (
    PRESETS,
    environment_variable,
    gpt_matrix_shapes,
    make_params,
    median,
    parse_set,
    plain_newton_schulz,
    symmetric_newton_schulz,
    time_steps,
)
from orthoptim.benchmark_counts import count_step, largest_megabatch_bytes, state_bytes, tensor_bytes
from orthoptim.kernels import cpu_dtype, select
from orthoptim.train.results import format_table, plots_available, save_figure, write_json

CPU_SETS = "124m:4"
# Rungs that get an fp32 twin on CPUs whose default iteration dtype is bf16.
FP32_COMPANIONS = ("muon", "muon+gram", "dion3_f1/4")
SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
CUDA_SETS = "124m,1b,7b:8"
GPU_ONLY_SETS = {"7b"}

COLUMNS = ["set", "optimizer", "median_ms", "vs_muon", "vs_adamw", "vs_adamw_fused", "gflop", "gb_moved", "passes",
           "elementwise_passes", "state_bytes", "state_ratio", "peak_transient_bytes", "transient_ratio",
           "gflop_per_s", "gb_per_s", "note"]


@dataclass
class Rung:
    name: str
    make: Callable[[list[Tensor]], torch.optim.Optimizer]
    note: str
    priority: int  # execution order: the references and cheap rungs first, so a time budget drops the rest
    cpu_dtype: str | None = None  # ORTHOPTIM_CPU_DTYPE while the rung runs (None: the library's choice)


def _fused_adamw_works(device: torch.device) -> str | None:
    """None when torch.optim.AdamW(fused=True) steps on ``device``, else why not."""
    try:
        p = torch.zeros(2, device=device, requires_grad=True)
        p.grad = torch.ones_like(p)
        torch.optim.AdamW([p], fused=True).step()
    except (RuntimeError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
    return None


def _slow_bf16_matmul(device: torch.device) -> float | None:
    """On CPU: how many times slower a bf16 matmul is than fp32 (None on CUDA). Without AVX-512 BF16
    or AMX, torch multiplies bf16 through a slow path (~50x on AVX2), which is all torch.optim.Muon
    does."""
    if device.type != "cpu":
        return None
    a32 = torch.randn(256, 256)
    a16 = a32.bfloat16()
    t32 = median(time_steps(lambda: a32 @ a32, warmup=1, repeats=3))
    t16 = median(time_steps(lambda: a16 @ a16, warmup=1, repeats=3))
    return t16 / t32


def _kernel_note(device: torch.device, sizes: list[int], dtype: torch.dtype) -> str:
    """Which backend runs the symmetric products of side k, for each k the rung orthogonalizes."""
    probe = torch.empty(0, device=device, dtype=dtype)
    by_backend: dict[str, list[int]] = {}
    for k in sorted(set(sizes)):
        try:
            backend = kernels.backend(probe, size=k)
        except ImportError:  # ORTHOPTIM_KERNELS=triton without triton: the step itself will say so
            backend = "triton (not installed)"
        by_backend.setdefault(backend, []).append(k)
    if device.type != "cuda" and set(by_backend) <= {"torch"}:
        if dtype == torch.bfloat16 and cpu_dtype.amx_tiles():
            return (f"kernels: torch fallback (no Triton on CPU; bf16 products on AMX blocked from k = "
                    f"{select.AMX_BF16_MIN_BLOCKED_SIZE})")
        return (f"kernels: torch fallback (no Triton on CPU; blocked products from k = {kernels.MIN_BLOCKED_SIZE}, "
                f"X Xᵀ of X with n >= {select.WIDE_GRAM_ASPECT}k from k = {select.MIN_BLOCKED_WIDE_GRAM_SIZE})")
    if len(by_backend) == 1:
        return f"kernels: {next(iter(by_backend))}"
    return "kernels: " + ", ".join(f"{b} for k={'/'.join(map(str, ks))}" for b, ks in sorted(by_backend.items()))


def rungs(device: torch.device, shapes: list[tuple[int, int]]) -> dict[str, Rung]:
    """Every rung, in table order. ``shapes`` only feeds the notes (which kernels run where).

    On a CPU the iterations run in ``orthoptim.kernels.cpu_dtype``'s choice: bf16 where the CPU has
    bf16 matrix units (the "gram" orthogonalizer then runs standard NS: Gram NS is unstable in bf16). The
    ``_fp32`` rungs pin fp32 there, which is what every other CPU runs.
    """
    cuda = device.type == "cuda"
    short = [min(m, n) for m, n in shapes]
    gram_sides = [min(m, n) for m, n in shapes if m != n]  # square matrices take standard NS
    precision = "bf16" if cuda else SHORT_DTYPE[cpu_dtype.iteration_dtype()]
    bf16_cpu = not cuda and precision == "bf16"
    gram = ("'gram' in bf16: standard NS (Gram NS is unstable in bf16)" if bf16_cpu else
            f"Gram NS, {'fp16' if cuda else 'fp32'}")
    gram_dtype = torch.float16 if cuda else cpu_dtype.iteration_dtype()  # the products' dtype, for the notes
    out = {
        "adamw": Rung("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
                      "torch.optim.AdamW foreach: the memory floor", 0),
        "adamw_fused": Rung("adamw_fused", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True),
                            "torch.optim.AdamW fused", 1),
        "muon": Rung("muon", lambda p: orthoptim.Muon(p, lr=0.01, orthogonalizer="polar_express"),
                     f"standard NS, Polar Express, {precision}"
                     + ("; " + _kernel_note(device, short, torch.bfloat16) if not cuda else ""), 2),
        "muon_bmm": Rung("muon_bmm", lambda p: orthoptim.Muon(p, lr=0.01, orthogonalizer=plain_newton_schulz),
                         f"standard NS, {precision}, every product a plain bmm", 8),
        "muon+sym": Rung("muon+sym", lambda p: orthoptim.Muon(p, lr=0.01, orthogonalizer=symmetric_newton_schulz),
                         f"standard NS, {precision}; " + _kernel_note(device, short, torch.bfloat16), 8),
        "muon+gram": Rung("muon+gram", lambda p: orthoptim.Muon(p, lr=0.01, orthogonalizer="gram"),
                          f"{gram}; " + _kernel_note(device, short if bf16_cpu else gram_sides, gram_dtype), 7),
    }
    for label, f in (("1/2", 0.5), ("1/4", 0.25), ("1/8", 0.125)):
        rows = [math.ceil(f * m) for m, n in shapes]
        sides = [min(k, n) for k, (m, n) in zip(rows, shapes) if k != n or bf16_cpu]
        out[f"dion3_f{label}"] = Rung(
            f"dion3_f{label}", partial(orthoptim.Dion3, lr=0.01, fraction=f),
            f"{'standard NS, bf16' if bf16_cpu else 'Gram NS'} on {label} of the rows; "
            + _kernel_note(device, sides, gram_dtype), {0.5: 6, 0.25: 3, 0.125: 4}[f])
    out["dion_r1/4"] = Rung("dion_r1/4", partial(orthoptim.Dion, lr=0.01, rank_fraction=0.25),
                            "rank ceil(min(m,n)/4), Cholesky-QR", 5)
    out["torch_muon"] = Rung("torch_muon", lambda p: torch.optim.Muon(p, lr=0.01),
                             "torch.optim.Muon (bf16 NS): outside reference", 9)
    for name in FP32_COMPANIONS if not cuda else ():  # ORTHOPTIM_CPU_DTYPE means nothing on a GPU
        base = out[name]
        note = {"muon": "standard NS, Polar Express, fp32", "muon+gram": "Gram NS, fp32",
                "dion3_f1/4": "Gram NS on 1/4 of the rows, fp32"}[name]
        out[f"{name}_fp32"] = Rung(f"{name}_fp32", base.make, f"{note} (ORTHOPTIM_CPU_DTYPE=float32)",
                                   base.priority + 10, cpu_dtype="float32")
    return out


def default_rungs(device: torch.device, known: list[str]) -> list[str]:
    """All rungs, but the ``_fp32`` ones only on CPUs whose default is bf16 (elsewhere they repeat)."""
    companions = device.type == "cpu" and cpu_dtype.iteration_dtype() != torch.float32
    return [n for n in known if companions or not n.endswith("_fp32")]


def _cpu_capability() -> str:
    get = getattr(torch.backends.cpu, "get_cpu_capability", None)  # torch >= 2.1
    return get() if get is not None else "unknown"


def environment(device: torch.device, threads: int) -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": str(device), "cpu": cpu,
           "cpu_capability": _cpu_capability(), "threads": threads,
           "torch": torch.__version__, "python": platform.python_version(),
           "commit": git("rev-parse", "--short", "HEAD") or None,
           "uncommitted_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
           "orthoptim_kernels": os.environ.get(kernels.ENV_VAR, "") or "auto",
           "orthoptim_cpu_dtype": cpu_dtype.describe()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def device_limits(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """Measured matmul GFLOP/s in the dtype Newton-Schulz runs in (bf16 on CUDA, the CPU's choice
    elsewhere; on CPUs also fp32) and copy GB/s (read + write) of large tensors: the rates the
    ladder's achieved rates are set against."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 2048

    def matmul_rate(mm_dtype: torch.dtype) -> float:
        a = torch.randn(n, n, device=device, dtype=mm_dtype)
        # The fastest of several runs: a limit, and a shared machine only ever slows a run down.
        return 2 * n**3 / min(time_steps(lambda: a @ a, warmup=2, repeats=5, device=device)) / 1e6

    mm_dtype = torch.bfloat16 if cuda else cpu_dtype.iteration_dtype()
    limits = {"matmul_dtype": str(mm_dtype).removeprefix("torch."), "matmul_gflop_per_s": matmul_rate(mm_dtype)}
    if not cuda and mm_dtype != torch.float32:
        limits["matmul_fp32_gflop_per_s"] = matmul_rate(torch.float32)
    numel = (1 << 28) if cuda else (1 << 25)
    x = torch.empty(numel, device=device, dtype=dtype)
    y = torch.empty_like(x)
    tc = min(time_steps(lambda: y.copy_(x), warmup=2, repeats=5, device=device))
    limits["copy_gb_per_s"] = 2 * x.numel() * x.element_size() / tc / 1e6
    return limits


def counted_kernels(device: torch.device) -> AbstractContextManager[None]:
    """On GPUs, count a step as the torch backend computes it: Triton kernels launch outside aten,
    where the counters cannot see them. The FLOPs of symmetric products are then dense-equivalent
    (the Triton kernels compute about half of each); timing and the CUDA memory peak use the real
    kernels. On CPUs the blocked symmetric products are aten GEMMs on views, which the counters see:
    the counted step is the timed one."""
    return environment_variable(kernels.ENV_VAR, "torch") if device.type != "cpu" else contextlib.nullcontext()


def run_rung(rung: Rung, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
             args: argparse.Namespace) -> dict[str, Any]:
    with environment_variable(cpu_dtype.ENV_VAR, rung.cpu_dtype):
        return _run_rung(rung, shapes, device, dtype, args)


def more_times(rung: Rung, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
               args: argparse.Namespace) -> list[float]:
    """Another round of a rung: a fresh optimizer, its warm-up, ``--repeats`` timed steps (no counters)."""
    with environment_variable(cpu_dtype.ENV_VAR, rung.cpu_dtype):
        params = make_params(shapes, device=device, dtype=dtype, seed=args.seed, on_device=device.type == "cuda")
        opt = rung.make(params)
        return time_steps(opt.step, warmup=args.warmup + 1, repeats=args.repeats, device=device)


def pool_times(row: dict[str, Any], times: list[float]) -> None:
    """Add a later round's times to a row and recompute what depends on the median."""
    row["times_ms"] = row["times_ms"] + times
    row["median_ms"] = ms = median(row["times_ms"])
    row["gflop_per_s"] = row["flops"] / ms / 1e6
    row["gb_per_s"] = row["bytes_moved"] / ms / 1e6


def _run_rung(rung: Rung, shapes: list[tuple[int, int]], device: torch.device, dtype: torch.dtype,
              args: argparse.Namespace) -> dict[str, Any]:
    params = make_params(shapes, device=device, dtype=dtype, seed=args.seed, on_device=device.type == "cuda")
    opt = rung.make(params)
    # At least one step before the counts: a first step that creates state (torch.optim's lazily) would
    # count that state as transient memory and its writes as passes.
    for _ in range(max(args.warmup, 1)):
        opt.step()
    cuda = device.type == "cuda"
    with counted_kernels(device):
        counts = count_step(opt.step, params, device)  # untimed: the counters slow the step down
    peak, source = counts.peak_transient_bytes, counts.transient_source
    if cuda:  # the allocator's peak over the timed steps, with the kernels they really use
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    times = time_steps(opt.step, warmup=0, repeats=args.repeats, device=device)
    if cuda:
        peak, source = torch.cuda.max_memory_allocated(device) - baseline, "cuda allocator, timed steps"
    mb = largest_megabatch_bytes(params)
    param_bytes = tensor_bytes(params)
    st = state_bytes(opt)
    ms = median(times)
    row = {
        "median_ms": ms, "times_ms": times, "flops": counts.flops, "gflop": counts.flops / 1e9,
        "bytes_moved": counts.bytes_moved, "gb_moved": counts.bytes_moved / 1e9, "passes": counts.passes,
        "elementwise_passes": counts.elementwise_passes, "state_bytes": st, "state_ratio": st / param_bytes,
        "peak_transient_bytes": peak, "transient_ratio": peak / mb,
        "transient_source": source, "gflop_per_s": counts.flops / ms / 1e6,
        "gb_per_s": counts.bytes_moved / ms / 1e6,
        "top_ops": [{"op": op, "passes": p, "calls": c} for op, p, c in counts.top_ops(args.top_ops)],
        "ops": counts.ops,
    }
    del opt, params
    return row


def skipped(set_name: str, rung: Rung, why: str) -> dict[str, Any]:
    row: dict[str, Any] = {c: None for c in COLUMNS}
    row.update(set=set_name, optimizer=rung.name, note=f"skipped: {why}", times_ms=[], top_ops=[], ops={})
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    ref = {r["optimizer"]: r["median_ms"] for r in rows if r["median_ms"] is not None}
    for r in rows:
        ms = r["median_ms"]
        r["vs_muon"] = ms / ref["muon"] if ms is not None and "muon" in ref else None
        r["vs_adamw"] = ms / ref["adamw"] if ms is not None and "adamw" in ref else None
        r["vs_adamw_fused"] = ms / ref["adamw_fused"] if ms is not None and "adamw_fused" in ref else None


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["set", "optimizer", "median ms", "vs muon", "vs adamw", "vs fused", "GFLOP/step", "GB moved", "passes (ew)",
            "state MiB (×params)", "peak transient MiB (×megabatch)", "GFLOP/s", "GB/s", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 3) + ["---"]) + "|"]
    for r in rows:
        if r["median_ms"] is None:
            cells = [r["set"], r["optimizer"]] + ["-"] * (len(head) - 3) + [r["note"]]
        else:
            cells = [r["set"], r["optimizer"], _fmt(r["median_ms"], ".1f"), _fmt(r["vs_muon"], ".3f"),
                     _fmt(r["vs_adamw"], ".2f"), _fmt(r["vs_adamw_fused"], ".2f"), _fmt(r["gflop"], ".1f"),
                     _fmt(r["gb_moved"], ".2f"),
                     f"{r['passes']:.1f} ({r['elementwise_passes']:.1f})",
                     f"{r['state_bytes'] / 2**20:.0f} ({r['state_ratio']:.3f})",
                     f"{r['peak_transient_bytes'] / 2**20:.0f} ({r['transient_ratio']:.2f})",
                     _fmt(r["gflop_per_s"], ".1f"), _fmt(r["gb_per_s"], ".1f"), r["note"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def top_ops_table(rows: list[dict[str, Any]]) -> str:
    body = [[r["set"], r["optimizer"], ", ".join(f"{o['op']} {o['passes']:.1f} ({o['calls']})" for o in r["top_ops"])]
            for r in rows if r["top_ops"]]
    return format_table(["set", "optimizer", "ops moving the most bytes: passes (calls)"], body,
                        right=[False, False, False])


def plot(rows: list[dict[str, Any]], sets: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["optimizer"] for r in rows))
    width = 0.8 / max(len(sets), 1)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.0 * len(names) + 2), 4.8))
    colors = ["#3a7bd5", "#e07b39", "#5aa469", "#8e6bbf"]
    skipped_at: list[float] = []
    for j, s in enumerate(sets):
        by_name = {r["optimizer"]: r for r in rows if r["set"] == s}
        xs, ys, labels = [], [], []
        for i, n in enumerate(names):
            r = by_name.get(n)
            x = i + (j - (len(sets) - 1) / 2) * width
            if r is not None and r["median_ms"] is not None:
                xs.append(x)
                ys.append(r["median_ms"])
                labels.append(r["median_ms"])
            elif r is not None:
                skipped_at.append(x)
        bars = ax.bar(xs, ys, width=width * 0.95, color=colors[j % len(colors)], label=s)
        for bar, ms in zip(bars, labels):
            text = f"{ms:,.0f}" if ms >= 10 else f"{ms:.2g}"
            ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6.5, rotation=90 if len(sets) > 1 else 0, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_xlim(-0.6, len(names) - 0.4)  # room for the "skipped" marks, which are not bars
    ax.set_yscale("log")
    ax.set_ylabel("optimizer.step() median, ms (log scale)")
    top = max((r["median_ms"] for r in rows if r["median_ms"] is not None), default=1.0)
    ax.set_ylim(top=top * 4)
    for x in skipped_at:
        ax.annotate("skipped", (x, ax.get_ylim()[0]), ha="center", va="bottom", fontsize=6.5, rotation=90,
                    color="#777777", xytext=(0, 3), textcoords="offset points")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=8, title="matrix set", title_fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def _limits_text(limits: dict[str, Any]) -> str:
    text = f"matmul {limits['matmul_gflop_per_s']:.0f} GFLOP/s {limits['matmul_dtype']}"
    if "matmul_fp32_gflop_per_s" in limits:
        text += f" ({limits['matmul_fp32_gflop_per_s']:.0f} float32)"
    return text + f", copy {limits['copy_gb_per_s']:.1f} GB/s"


def _iterations(env: dict[str, Any]) -> str:
    """The CPU iterations' dtype a run recorded ("" on CUDA, and for JSON written before it was)."""
    return "" if env["device"].startswith("cuda") else env.get("orthoptim_cpu_dtype", "")


def _rounds(results: dict[str, Any]) -> str:
    rounds = results.get("rounds", 1)
    return f", {rounds} rounds over the rungs (each rung's repeats pooled)" if rounds > 1 else ""


def report(results: dict[str, Any], png: str | None, top_ops: int) -> None:
    """Print the tables of a ladder run (fresh or loaded from its JSON) and draw its PNG."""
    env, limits, rows = results["environment"], results["device_limits"], results["rows"]
    cuda = env["device"].startswith("cuda")
    for label in results["sets"]:
        add_ratios([r for r in rows if r["set"] == label])
    iterations = _iterations(env)
    cpu_iterations = f" (CPU iterations: {iterations})" if iterations else ""
    print(f"\noptimizer.step() ladder: {env['device']}{' (' + env['gpu'] + ')' if cuda else ''}, "
          f"parameters {results['dtype']}{cpu_iterations}, {env['threads']} thread(s), torch {env['torch']}, "
          f"commit {env['commit']}"
          f"{' (+ uncommitted changes)' if env['uncommitted_changes'] else ''}; medians of {results['repeats']} "
          f"after {results['warmup']} warm-up{_rounds(results)}; device: {_limits_text(limits)}\n")
    for label, info in results["sets"].items():
        print(f"- {label}: d_model {info['d_model']}, {info['layers']} of {info['preset_layers']} layers, "
              f"{info['parameters'] / 1e6:.1f} M parameters = {info['param_bytes'] / 2**20:.0f} MiB, largest "
              f"megabatch {info['largest_megabatch_bytes'] / 2**20:.0f} MiB")
    print()
    print(markdown_table(rows))
    print("\npasses: bytes moved / parameter bytes (ew: without matrix products); transient: peak bytes allocated "
          "during the step beyond parameters, gradients and state "
          f"({', '.join(sorted({r['transient_source'] for r in rows if 'transient_source' in r})) or 'none'}); "
          "MiB = 2**20 bytes, GB = 10**9\n")
    if top_ops:
        print(top_ops_table(rows))
    if results.get("stopped"):
        print(f"\nstopped: {results['stopped']}")
    for module, why in results.get("triton_turned_off", {}).items():
        print(f"\nTriton turned off during the run: {module}: {why}")
    if png:
        title = (f"optimizer.step() median, {env.get('gpu', env['cpu'])}, {env['threads']} thread(s), "
                 f"parameters {results['dtype']}{', iterations ' + iterations if iterations else ''}, "
                 f"torch {env['torch']}")
        plot(rows, list(results["sets"]), Path(png), title)
        print(f"\nwrote {png}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default=None,
                        help=f"comma list of NAME, NAME:LAYERS (NAME from {', '.join(PRESETS)}) or dWIDTHxLAYERS "
                             f"(default: {CPU_SETS} on CPU, {CUDA_SETS} on CUDA)")
    parser.add_argument("--optimizers", default=None, help="comma list of rungs (default: all)")
    parser.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameters and state")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first, at least 1 (default: 1 CPU, 3 CUDA)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps (default: 3 CPU, 10 CUDA)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every rung this many times, one round after another, and pool the repeats: "
                             "a shared machine's load then weighs on every rung alike (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no new rung after this many seconds (the rest are listed as skipped); "
                             "the i-th of N sets starts none after i/N of it, so the last set keeps its share "
                             "(what a set leaves unspent passes to the next)")
    parser.add_argument("--top-ops", type=int, default=4, help="ops listed per rung in the bytes breakdown")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--png", default=None, help="bar chart of median ms here (needs matplotlib)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="measure nothing: print the tables (and --png) of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.png and not plots_available():
        parser.error("--png needs matplotlib (pip install matplotlib, or pip install orthoptim[plot])")
    if args.from_json:
        report(json.loads(Path(args.from_json).read_text()), args.png, args.top_ops)
        return 0

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available to this torch ({torch.__version__})")
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    args.repeats = args.repeats if args.repeats is not None else (10 if cuda else 3)
    for flag, value, low in (("--warmup", args.warmup, 0), ("--repeats", args.repeats, 1), ("--rounds", args.rounds, 1),
                             ("--threads", args.threads, 1), ("--top-ops", args.top_ops, 0)):
        if value < low:
            parser.error(f"{flag} {value} must be >= {low}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    try:
        sets = [parse_set(s) for s in (args.sets or (CUDA_SETS if cuda else CPU_SETS)).split(",") if s]
    except ValueError as e:
        parser.error(str(e))
    known = list(rungs(device, [(2, 2)]))
    wanted = args.optimizers.split(",") if args.optimizers else default_rungs(device, known)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        parser.error(f"unknown optimizers {unknown}; known: {', '.join(known)}")

    env = environment(device, torch.get_num_threads())
    say = partial(print, file=sys.stderr, flush=True)
    say(f"ladder: {device}{' (' + env['gpu'] + ')' if cuda else ''}, {args.dtype}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, {args.warmup} warm-up + 1 counted "
        f"+ {args.repeats} timed steps per rung")
    limits = device_limits(device, dtype)
    say(f"ladder: device limits measured here: {_limits_text(limits)}")
    no_fused = _fused_adamw_works(device)
    bf16_slowdown = _slow_bf16_matmul(device)
    started = time.time()
    failed = [0]  # rungs that raised, and a stop: counted where they happen (run_set)
    results: dict[str, Any] = {"environment": env, "device_limits": limits, "dtype": args.dtype,
                               "warmup": max(args.warmup, 1), "repeats": args.repeats, "rounds": args.rounds,
                               "columns": COLUMNS,
                               "sets": {}, "rows": []}

    def save() -> None:
        if args.json:
            results["wall_s"] = time.time() - started
            write_json(args.json, results)

    def publish(label: str, rows: dict[str, dict[str, Any]]) -> None:
        ordered = [rows[n] for n in wanted if n in rows]
        add_ratios(ordered)
        results["rows"] = [r for r in results["rows"] if r["set"] != label] + ordered
        save()

    def gpu_only(label: str) -> bool:
        return label.partition(":")[0] in GPU_ONLY_SETS and not cuda

    for label, d_model, layers, _ in filter(lambda s: gpu_only(s[0]), sets):
        say(f"ladder: skipping {label}: the 7B-like set is GPU-only "
            f"({sum(m * n for m, n in gpt_matrix_shapes(d_model, layers)) / 1e9:.1f} B parameters; one Muon step "
            "would take hours on a CPU)")
    sets = [s for s in sets if not gpu_only(s[0])]  # the budget's shares go to the sets that run

    def deadline(set_index: int) -> float:
        return math.inf if args.budget_s is None else started + args.budget_s * (set_index + 1) / len(sets)

    def run_set(set_index: int, label: str, d_model: int, layers: int, full: int) -> None:
        """Every rung of one set, timed, published into ``results`` as it goes; failures are counted in
        ``failed`` as they happen, so a stop in the middle of a set keeps the count."""
        shapes = gpt_matrix_shapes(d_model, layers)
        all_rungs = rungs(device, shapes)
        param_bytes = sum(m * n for m, n in shapes) * dtype.itemsize
        info = {"d_model": d_model, "layers": layers, "preset_layers": full,
                "matrices": len(shapes), "parameters": sum(m * n for m, n in shapes), "param_bytes": param_bytes,
                "largest_megabatch_bytes": max(
                    sum(m * n for m, n in shapes if (m, n) == s) for s in set(shapes)) * dtype.itemsize,
                "shapes": sorted({f"{m}x{n}" for m, n in shapes})}
        results["sets"][label] = info
        say(f"ladder: set {label}: d_model {d_model}, {layers} of {full} layers, {len(shapes)} matrices, "
            f"{info['parameters'] / 1e6:.1f} M parameters ({param_bytes / 2**20:.0f} MiB)")
        rows: dict[str, dict[str, Any]] = {}
        for rung in sorted((all_rungs[n] for n in wanted), key=lambda r: r.priority):
            why = None
            if rung.name == "adamw_fused" and no_fused:
                why = f"fused AdamW does not run on {device.type} ({no_fused})"
            elif rung.name == "torch_muon" and not hasattr(torch.optim, "Muon"):
                why = f"torch {torch.__version__} has no torch.optim.Muon"
            elif rung.name == "torch_muon" and bf16_slowdown and bf16_slowdown > 5 and not args.optimizers:
                why = (f"bf16 matmul is {bf16_slowdown:.0f}x slower than fp32 on this CPU "
                       f"({env['cpu_capability']}); list it in --optimizers to run it anyway")
            elif args.budget_s is not None and time.time() > deadline(set_index):
                why = (f"time budget spent ({deadline(set_index) - started:.0f} s of --budget-s {args.budget_s:g} "
                       f"by the end of set {set_index + 1} of {len(sets)})")
            if why:
                row = skipped(label, rung, why)
                say(f"  {label:>8} {rung.name:<12} {row['note']}")
            else:
                row = {"set": label, "optimizer": rung.name, "note": rung.note}
                t0, triton_off_before = time.time(), set(select._triton_off)
                try:
                    row.update(run_rung(rung, shapes, device, dtype, args))
                except torch.cuda.OutOfMemoryError:
                    row = skipped(label, rung, "out of GPU memory")
                except Exception as e:  # one broken rung must not cost the rungs and sets after it
                    traceback.print_exc()
                    row = skipped(label, rung, f"failed: {type(e).__name__}: {str(e)[:200]}")
                    failed[0] += 1
                if cuda:
                    torch.cuda.empty_cache()
                if set(select._triton_off) - triton_off_before:  # the note said Triton; this rung fell back
                    off = {m: select._triton_off[m] for m in set(select._triton_off) - triton_off_before}
                    row["note"] += "; Triton turned off during this rung (torch from then on): " + "; ".join(
                        f"{m}: {why[:160]}" for m, why in off.items())
                if row["median_ms"] is not None:
                    say(f"  {label:>8} {rung.name:<12} {row['median_ms']:10.1f} ms  {row['gflop']:8.1f} GFLOP  "
                        f"{row['passes']:5.1f} passes  ({time.time() - t0:.0f} s)")
                else:
                    say(f"  {label:>8} {rung.name:<12} {row['note']}")
            rows[rung.name] = row
            publish(label, rows)
        for round_index in range(1, args.rounds):  # the same rungs again: load drifts hit every rung alike
            for name in [n for n in wanted if rows.get(n, {}).get("median_ms") is not None]:
                if args.budget_s is not None and time.time() > deadline(set_index):
                    break
                try:
                    pool_times(rows[name], more_times(all_rungs[name], shapes, device, dtype, args))
                except Exception:  # the first round's times stand
                    traceback.print_exc()
                    failed[0] += 1
                say(f"  {label:>8} {name:<12} {rows[name]['median_ms']:10.1f} ms  (round {round_index + 1})")
            publish(label, rows)

    try:
        for set_index, (label, d_model, layers, full) in enumerate(sets):
            run_set(set_index, label, d_model, layers, full)
    except KeyboardInterrupt:  # a stop (gpu_check's time cap sends SIGINT): report what was measured
        results["stopped"] = "interrupted (SIGINT) while a rung ran; the rows measured before are kept"
        say(f"ladder: {results['stopped']}")
        failed[0] += 1
    failures = failed[0]
    if select._triton_off:
        results["triton_turned_off"] = dict(select._triton_off)

    report(results, args.png, args.top_ops)
    save()
    if args.json:
        print(f"wrote {args.json}")
    if failures:
        print(f"ladder: {failures} rung(s) failed or were stopped (tracebacks above; their rows say why)",
              file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
