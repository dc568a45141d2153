"""Run a function on N real torch.distributed processes (gloo, CPU) with a hard timeout.

Each rank calls ``fn(rank, world_size, *args)``; what it returns is saved and handed back to the
test as a list indexed by rank. A rank that raises or hangs fails the test instead of blocking CI.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
