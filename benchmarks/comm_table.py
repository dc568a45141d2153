"""Collectives and bytes per optimizer step on a GPT-shaped matrix set, measured on real gloo ranks.

    python benchmarks/comm_table.py --set d512 --world 2 --json results/comm_table.json

For each optimizer and layout (FSDP2 Shard(0) rows, tensor-parallel Shard(1) columns, DDP-replicated),
one step runs with ``opt.comm_stats`` attached; the table lists calls and MiB sent per rank for each collective kind.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import orthoptim
from orthoptim.benchmark import PRESETS, gpt_matrix_shapes
from orthoptim.distributed import CommStats

OPTIMIZERS = {
    "muon": lambda params, mesh: orthoptim.Muon(params, distributed_mesh=mesh),
    "dion3 f=1/2": lambda params, mesh: orthoptim.Dion3(params, fraction=0.5, distributed_mesh=mesh),
    "dion3 f=1/4": lambda params, mesh: orthoptim.Dion3(params, fraction=0.25, distributed_mesh=mesh),
    "dion3 f=1/8": lambda params, mesh: orthoptim.Dion3(params, fraction=0.125, distributed_mesh=mesh),
    "dion r=1/4": lambda params, mesh: orthoptim.Dion(params, rank_fraction=0.25, distributed_mesh=mesh),
}
DION_TP = lambda params, mesh: orthoptim.Dion(params, rank_fraction=0.25, inner_shard_mesh=mesh)  # noqa: E731
PLACEMENT = {"fsdp": 0, "tp": 1}  # the sharded dim of each matrix


def _worker(rank: int, world: int, port: int, preset: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = gpt_matrix_shapes(*PRESETS[preset])
    rows = []
    for layout in ("fsdp", "tp", "ddp"):
        for name, make in OPTIMIZERS.items():
            if layout == "tp" and name.startswith("dion r"):
                make = DION_TP
            gen = torch.Generator().manual_seed(0)
            full = [torch.randn(s, generator=gen) for s in shapes]
            grads = [torch.randn(s, generator=gen) for s in shapes]
            if layout in PLACEMENT:
                placements = [Shard(PLACEMENT[layout])]
                params = [torch.nn.Parameter(distribute_tensor(t, mesh, placements)) for t in full]
                for p, g in zip(params, grads):
                    p.grad = distribute_tensor(g, mesh, placements)
            else:
                params = [torch.nn.Parameter(t) for t in full]
                for p, g in zip(params, grads):
                    p.grad = g
            opt = make(params, mesh)
            opt.comm_stats = CommStats()
            opt.step()
            rows.append({"layout": layout, "optimizer": name, "comm": opt.comm_stats.as_dict(),
                         "shape_groups": len(set(shapes))})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    os._exit(0)  # skip interpreter teardown (see tests/distributed_harness.py)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="d512", choices=sorted(PRESETS))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--json", default="results/comm_table.json")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, args=(args.world, port, args.set, out), nprocs=args.world, start_method="spawn")
        with open(out) as f:
            rows = json.load(f)
    d_model, layers = PRESETS[args.set]
    params = sum(a * b for a, b in gpt_matrix_shapes(d_model, layers))
    print(f"{args.set}: d_model {d_model}, {layers} layers, {params / 1e6:.1f}M matrix parameters, "
          f"{rows[0]['shape_groups']} shape groups, {args.world} ranks; per rank, one step")
    print(f"{'layout':<6} {'optimizer':<20} {'collectives':<40} {'MiB sent':>9}")
    for r in rows:
        calls = ", ".join(f"{k} x{v['calls']}" for k, v in r["comm"].items())
        mib = sum(v["bytes"] for v in r["comm"].values()) / 2**20
        r["mib_sent"] = mib
        print(f"{r['layout']:<6} {r['optimizer']:<20} {calls:<40} {mib:>9.2f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json + ".tmp", "w") as f:
        json.dump({"set": args.set, "world": args.world, "rows": rows}, f, indent=2)
    os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    sys.exit(main())
