"""A dependency-free progress line on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 \
        else f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 24, enabled: bool = True) -> None:
        self.total, self.width, self.enabled = total, width, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last_draw = 0.0
        self.last_decile = -1
        self.start = time.perf_counter()
        self.first_step: int | None = None

    def __call__(self, name: str, step: int, info: dict) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.first_step is None:  # a resumed run starts part-way: the ETA counts from here
            self.first_step, self.start = step - 1, now
        done = step >= self.total
        decile = 10 * step // self.total
        if self.tty and not done and now - self.last_draw < 0.2:
            return
        if not self.tty and not done and decile == self.last_decile:
            return
        self.last_draw, self.last_decile = now, decile
        filled = self.width * step // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        rate = (now - self.start) / max(step - self.first_step - 1, 1)  # per step, from the second step on
        if done:
            eta = f"in {_clock(now - self.start)}"
        else:
            eta = f"ETA {_clock(rate * (self.total - step))}" if step - self.first_step > 1 else "ETA -:--"
        line = (f"{name:<8} [{bar}] {step:>{len(str(self.total))}}/{self.total}  loss {info['loss']:.3f}  "
                f"val {info['val']:.3f}  {info['tok_s'] / 1e3:.1f}k tok/s  {eta}")
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done else "\x1b[K"))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
