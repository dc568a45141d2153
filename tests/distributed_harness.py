"""Real torch.distributed processes (gloo, CPU) for tests, each launch with a hard timeout.

``run_distributed``: each rank calls ``fn(rank, world_size, *args)``; what it returns is saved and
handed back to the test as a list indexed by rank. A rank that raises or hangs fails the test
instead of blocking CI.

``torchrun``: the `orthoptim` command under a real ``torchrun`` launch, as a user runs it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orthoptim.train.loop import CPU_HSDP_MIN_TORCH

# FSDP2 cannot run HSDP over gloo (CPU) on older torch (the CLI refuses --hsdp on CPU there).
needs_cpu_hsdp = pytest.mark.skipif(torch.__version__ < CPU_HSDP_MIN_TORCH,
                                    reason=f"FSDP2 HSDP over gloo (CPU) needs torch >= {CPU_HSDP_MIN_TORCH}")


def value_error(fn: Callable[[], Any]) -> str:
    """The message of the ValueError that ``fn()`` raises on this rank, or "no error": what a test of
    a refusal sends back from every rank, to check that all refuse alike."""
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": True, "result": result}, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(outdir, f"rank{rank}.pt"))
        os._exit(1)
    # Every rank is past its last collective. Leave without interpreter teardown: background threads
    # of gloo / distributed checkpointing can abort the process while C++ destructors run.
    os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Spawn ``world_size`` gloo ranks running ``fn``; return their results or raise on error/timeout."""
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_worker, args=(world_size, _free_port(), outdir, fn, args), nprocs=world_size,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"distributed run of {fn.__name__} on {world_size} ranks hung > {timeout}s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            errors = []
            for r in range(world_size):
                path = os.path.join(outdir, f"rank{r}.pt")
                if os.path.exists(path):
                    rec = torch.load(path, weights_only=False)
                    if not rec["ok"]:
                        errors.append(f"rank {r}:\n{rec['error']}")
            raise AssertionError("\n".join(errors) or str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)["result"]
                for r in range(world_size)]


def torchrun(nproc: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node nproc -m orthoptim.cli *args``, one thread per process.

    The launcher runs in its own process group, so a hang kills the workers too (not only torchrun)
    and fails the test with their output. Workers run with faulthandler on, so a crash in native code
    prints every thread's Python stack. A launch in which a worker was killed by a signal other than
    the launcher's own SIGTERM (a native crash, not a Python error) is relaunched once, after a
    warning that carries the crashed workers' output; a second crash is returned to the test. A fresh
    run's ``--out`` folder is removed first; a ``--resume`` continues from its last checkpoint.
    """
    first = _launch(nproc, args, timeout)
    crash = _signal_from_worker(first.stderr)
    if first.returncode == 0 or crash is None:
        return first
    warnings.warn(f"torchrun {' '.join(args)}: a worker died by {crash}; relaunching once. Its output:\n"
                  f"{launch_report(first)}", stacklevel=2)
    if "--out" in args and "--resume" not in args:
        shutil.rmtree(Path(args[args.index("--out") + 1]), ignore_errors=True)
    return _launch(nproc, args, timeout)


def launch_report(done: subprocess.CompletedProcess, limit: int = 3000) -> str:
    """What the workers printed (their tracebacks, faulthandler stacks), without the launcher's own
    ChildFailedError traceback, which would otherwise fill the tail; then the launcher's summary."""
    err = done.stderr
    cut = err.rfind("Traceback (most recent call last):")
    if cut < 0 or "ChildFailedError" not in err[cut:]:
        return err[-limit:]
    summary = err[cut:]
    root = summary.find("Root Cause")
    return err[:cut][-limit:] + "\n[launcher] " + (summary[root:root + 800] if root >= 0 else summary[-800:])


def _launch(nproc: int, args: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "orthoptim.cli", *args]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"torchrun with {nproc} processes hung > {timeout}s: {' '.join(args)}\n{err[-2000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _signal_from_worker(stderr: str) -> str | None:
    """The signal that killed a worker, from the launcher's summary (``exitcode : -6``); None if every
    failed worker exited on its own or was stopped by the launcher (SIGTERM)."""
    for code in map(int, re.findall(r"exitcode\s*:\s*-(\d+)", stderr)):
        if code != signal.SIGTERM:
            return signal.Signals(code).name if code in signal.valid_signals() else f"signal {code}"
    return None
