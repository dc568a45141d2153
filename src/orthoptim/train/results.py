"""Writing results: atomic files (never half-written on Ctrl-C), the summary table, the plots."""

from __future__ import annotations

import glob
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO


def atomic_write_bytes(path: str | Path, data: bytes | bytearray) -> None:
    """Write to a temporary file in the same folder, then rename it over ``path``."""
    _atomic_write(path, lambda f: f.write(data))


def _atomic_write(path: str | Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a temporary file in ``path``'s folder, flushed to disk, then renamed over
    ``path``: after Ctrl-C, a kill or a crash, ``path`` is the old file or the new one, whole.
    Temporary files that a killed process left behind (``.NAME.PID.tmp``) are removed first (on POSIX,
    where a process's liveness can be asked without signalling it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*.tmp") if os.name == "posix" else ():
        pid = stale.name[len(path.name) + 2:-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if hasattr(os, "O_DIRECTORY"):  # the rename itself, on file systems that need the folder synced
        try:
            folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(folder)
        except OSError:
            pass
        finally:
            os.close(folder)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, but another user's
        return True
    return True


def write_json(path: str | Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, allow_nan=True) + "\n").encode())


def write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def save_torch(path: str | Path, obj: Any) -> None:
    """torch.save, atomically (checkpoints)."""
    import torch

    _atomic_write(path, lambda f: torch.save(obj, f))


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """A plain-text table: columns padded to their widest cell, a dashed rule under the header."""
    right = right or [i > 0 for i in range(len(header))]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).rjust(w) if r else str(c).ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def plots_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def ema(values: Sequence[float], beta: float = 0.9) -> list[float]:
    """Exponential moving average with bias correction (smooths noisy per-step training loss)."""
    out, avg = [], 0.0
    for i, v in enumerate(values):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def plot_losses(runs: dict[str, dict], path: str | Path, title: str) -> None:
    """loss.png: validation (lines with dots) and training loss (smoothed, thin) against step and
    against training wall time, one colour per optimizer."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lows, highs = [], []
    for i, (name, run) in enumerate(runs.items()):
        h = run["history"]
        color = colors[i % len(colors)]
        smooth = ema(h["train_loss"])
        for ax, x_train, x_val in ((axes[0], h["step"], h["val_step"]), (axes[1], h["time_s"], h["val_time_s"])):
            ax.plot(x_train, smooth, color=color, linewidth=0.9, alpha=0.45)
            ax.plot(x_val, h["val_loss"], color=color, linewidth=2, marker="o", markersize=3,
                    label=f"{name} (val {h['val_loss'][-1]:.3f})")
        lows.append(min(h["val_loss"] + smooth))
        # the top of the plot: the loss a tenth of the way in, so the first steps do not flatten the rest
        highs.append(smooth[len(smooth) // 10] if smooth else max(h["val_loss"]))
    if lows:
        low, high = min(lows), max(highs)
        if math.isfinite(low) and math.isfinite(high) and high > low:
            pad = 0.05 * (high - low)
            axes[0].set_ylim(low - pad, high + pad)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall time (s, evaluation excluded)")
    axes[0].set_ylabel("loss (nats/token)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(title="thick: validation, thin: training (EMA)", fontsize=8, title_fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path)
    plt.close(fig)


def plot_bench(rows: list[dict], path: str | Path, title: str) -> None:
    """bench.png: median optimizer step time per optimizer (bars), ratio to AdamW on each bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4.2))
    names = [r["optimizer"] for r in rows]
    ms = [r["median_ms"] for r in rows]
    bars = ax.bar(names, ms, color=["#888888" if n in ("adamw", "torch_muon") else "#3a7bd5" for n in names])
    for bar, r in zip(bars, rows):
        label = f"{r['median_ms']:,.0f} ms" if r["median_ms"] >= 100 else f"{r['median_ms']:.3g} ms"
        if r.get("vs_adamw") is not None:
            label += f"\n{r['vs_adamw']:.2g}x AdamW"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=7)
    ax.set_ylabel("optimizer.step() median (ms)")
    ax.set_ylim(0, max(ms) * 1.25 if ms else 1)
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)
    plt.close(fig)
