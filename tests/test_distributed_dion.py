"""Dion across ranks: compressed data-parallel sync (replicate_mesh), FSDP2 sharding (outer_shard_mesh),
tensor parallelism (inner_shard_mesh, rows or columns) and their 2-D combinations equal one process
that averages the gradients, exchanging only low-rank factors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import orthoptim
from orthoptim.distributed import CommStats
from tests.distributed_harness import run_distributed, value_error

REL_TOL = 1e-5  # fp32; the all-reduces sum in another order than one process does
STEPS = 3
SHAPES = [(18, 24), (18, 24), (40, 16), (3, 20), (5, 3)]  # uneven rows/cols on 4 ranks, empty shards, tall
HP = {"lr": 0.05, "rank_fraction": 0.5, "weight_decay": 0.1}


def _init() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen) for s in SHAPES] + [torch.randn(24, generator=gen)]


def _grads(step: int, replica: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    return [torch.randn(s, generator=gen) for s in SHAPES] + [torch.randn(24, generator=gen)]


def _groups(params):
    return [{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}]


def _reference(replicas: int, steps: int = STEPS) -> list[torch.Tensor]:
    """One process, gradients averaged over the replicas first."""
    params = [nn.Parameter(t) for t in _init()]
    opt = orthoptim.Dion(_groups(params), **HP)
    for step in range(steps):
        per_replica = [_grads(step, r) for r in range(replicas)]
        for i, p in enumerate(params):
            p.grad = torch.stack([g[i] for g in per_replica]).mean(0)
        opt.step()
    return [p.detach() for p in params]


# Layout → (mesh shape, mesh dim names, placements of the matrices). "replicate" dims carry
# different gradients per replica (compressed sync); "outer" is FSDP; "inner" is tensor parallelism.
LAYOUTS = {
    "replicate": ((None,), ("replicate",), None),
    "outer": ((None,), ("outer",), ("S0",)),
    "both": ((2, None), ("replicate", "outer"), ("R", "S0")),
    "inner_cols": ((None,), ("inner",), ("S1",)),  # row-parallel linear: columns split
    "inner_rows": ((None,), ("inner",), ("S0",)),  # column-parallel linear: rows split
    "outer_x_inner": ((2, None), ("outer", "inner"), ("S0", "S1")),  # 2-D: FSDP rows x TP columns
    "inner_x_outer": ((2, None), ("outer", "inner"), ("S1", "S0")),  # FSDP on dim 1, TP on dim 0
    "replicate_x_inner": ((2, None), ("replicate", "inner"), ("R", "S1")),
}


def _mesh(world: int, layout: str):
    from torch.distributed.device_mesh import init_device_mesh

    shape, names, _ = LAYOUTS[layout]
    shape = tuple(world // 2 if s is None and len(shape) == 2 else (world if s is None else s) for s in shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _setup(world: int, layout: str, **options):
    """The parameters placed as ``layout`` places them, their Dion, the placing function and this
    rank's replica index among how many."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh(world, layout)
    names = mesh.mesh_dim_names
    sub = {name: (mesh[name] if mesh.ndim > 1 else mesh) for name in names}
    replicas = mesh.size(names.index("replicate")) if "replicate" in names else 1
    replica = mesh.get_local_rank(names.index("replicate")) if "replicate" in names else 0
    pattern = LAYOUTS[layout][2]
    spec = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}

    def place(t: torch.Tensor) -> torch.Tensor:
        if pattern is None:
            return t
        # The bias: Shard(0) over the first sharding dim. src_data_rank=None: no broadcast, each
        # rank slices its own replica's tensor.
        placements = [spec[x] for x in pattern] if t.ndim == 2 else \
            [Shard(0) if i == next(j for j, x in enumerate(pattern) if x != "R") else Replicate()
             for i in range(len(pattern))]
        return distribute_tensor(t, mesh, placements, src_data_rank=None)

    params = [nn.Parameter(place(t)) for t in _init()]
    opt = orthoptim.Dion(_groups(params), replicate_mesh=sub.get("replicate"), outer_shard_mesh=sub.get("outer"),
                         inner_shard_mesh=sub.get("inner"), **HP, **options)
    return params, opt, place, replica, replicas


def _full(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in params]


def _run(rank: int, world: int, layout: str) -> dict:
    params, opt, place, replica, replicas = _setup(world, layout)
    opt.comm_stats = CommStats()
    comm = []
    for step in range(STEPS):
        for p, g in zip(params, _grads(step, replica)):
            p.grad = place(g)
        opt.comm_stats.reset()
        opt.step()
        comm.append(opt.comm_stats.as_dict())
    got = _full(params)
    want = _reference(replicas)
    return {"errors": [float((a - b).norm() / b.norm()) for a, b in zip(got, want)], "comm": comm}


# All-reduces per Dion megabatch: B Q summed over column blocks (1) and averaged over replicas (1); the
# r×r Gram of CholeskyQR2 over row blocks (2); Bᵀ P summed over row blocks (1), padded R over column
# blocks (1), averaged over replicas (1). Verdicts: one tiny all-reduce per group gradients differ over.
PER_BATCH = {"replicate": 2, "outer": 3, "both": 5, "inner_cols": 2, "inner_rows": 3, "outer_x_inner": 5,
             "inner_x_outer": 5, "replicate_x_inner": 4}
VERDICTS = {"replicate": 1, "outer": 1, "both": 2, "inner_cols": 1, "inner_rows": 1, "outer_x_inner": 2,
            "inner_x_outer": 2, "replicate_x_inner": 2}


def _run_layouts(rank: int, world: int, layouts: list[str]) -> dict:
    # One set of processes for many layouts: spawning ranks costs more than the steps.
    return {layout: _run(rank, world, layout) for layout in layouts}


@pytest.mark.parametrize(("world_size", "layouts"), [
    (2, ["replicate", "outer", "inner_cols", "inner_rows"]),
    (4, ["replicate", "outer", "both", "inner_cols", "outer_x_inner", "inner_x_outer", "replicate_x_inner"]),
])
def test_dion_distributed_matches_averaged_gradients(world_size, layouts):
    results = run_distributed(_run_layouts, world_size, layouts, timeout=240)
    megabatches = len(set(SHAPES))
    for layout in layouts:
        gradient_sync = 1 if "replicate" in layout or layout == "both" else 0  # the AdamW bias, averaged by Dion
        for rank, by_layout in enumerate(results):
            rec = by_layout[layout]
            assert max(rec["errors"]) <= REL_TOL, (rank, layout, rec["errors"])
            for step in rec["comm"]:
                expected = megabatches * PER_BATCH[layout] + VERDICTS[layout] + gradient_sync
                assert step["all_reduce"]["calls"] == expected, (layout, step)
                assert "all_gather" not in step and "all_to_all" not in step, (layout, step)


def _checkpoint_and_sync(rank: int, world: int, layout: str, path: str) -> dict:
    """Each replica's momentum differs under compressed sync (only their mean is the synchronized one),
    and torch.distributed.checkpoint saves replicated state from one rank: a run resumed from a
    checkpoint must take the step the run itself takes. Synchronized every step, the replicas' momenta
    are equal and the parameters those of one process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def module(params):
        holder = nn.Module()
        holder.params = nn.ParameterList(params)
        return holder

    def step(run, t):
        params, opt, place, replica, _ = run
        for p, g in zip(params, _grads(t, replica)):
            p.grad = place(g)
        opt.step()

    def rel(got, want):
        return max(float((a - b).norm() / b.norm()) for a, b in zip(got, want))

    run = _setup(world, layout)
    for t in range(STEPS):
        step(run, t)
    dcp.save({"optim": get_optimizer_state_dict(module(run[0]), run[1])}, checkpoint_id=path)
    at_save = [p.detach().clone() for p in run[0]]
    step(run, STEPS)

    resumed = _setup(world, layout)
    for p, value in zip(resumed[0], at_save):
        p.detach().copy_(value)
    state = {"optim": get_optimizer_state_dict(module(resumed[0]), resumed[1])}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(module(resumed[0]), resumed[1], state["optim"])
    step(resumed, STEPS)

    synced = _setup(world, layout, replica_sync_every=1)
    for t in range(STEPS):
        step(synced, t)
    momenta = torch.cat([m.reshape(-1) for m in _full([synced[1].state[p]["momentum"] for p in synced[0][:-1]])])
    everyone = [torch.empty_like(momenta) for _ in range(world)]
    dist.all_gather(everyone, momenta)
    replicas = run[4]
    return {"resumed_vs_uninterrupted": rel(_full(resumed[0]), _full(run[0])),
            "uninterrupted_vs_one_process": rel(_full(run[0]), _reference(replicas, STEPS + 1)),
            "synced_vs_one_process": rel(_full(synced[0]), _reference(replicas)),
            "momenta_differ_across_ranks": max(float((m - everyone[0]).abs().max()) for m in everyone)}


@pytest.mark.parametrize(("world_size", "layout"), [(2, "replicate"), (4, "both")])
def test_a_checkpoint_of_compressed_sync_resumes_exactly(world_size, layout, tmp_path):
    """Saved from one rank, the momentum used to be that rank's own: the resumed step was off by
    about one whole update."""
    for result in run_distributed(_checkpoint_and_sync, world_size, layout, str(tmp_path), timeout=180):
        assert result["resumed_vs_uninterrupted"] <= REL_TOL, result
        assert result["uninterrupted_vs_one_process"] <= REL_TOL, result
        assert result["synced_vs_one_process"] <= REL_TOL, result
        assert result["momenta_differ_across_ranks"] <= 1e-6, result


def _bytes(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for rank_fraction in (0.5, 0.25):
        params = [nn.Parameter(torch.randn(128, 256)) for _ in range(2)]
        opt = orthoptim.Dion(params, rank_fraction=rank_fraction, replicate_mesh=mesh)
        opt.comm_stats = CommStats()
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        out[rank_fraction] = opt.comm_stats.bytes["all_reduce"]
    return out


def test_compressed_sync_sends_low_rank_factors_not_gradients():
    by_fraction = run_distributed(_bytes, 2, timeout=60)[0]
    full_gradients = 2 * 128 * 256 * 4
    for rank_fraction, sent in by_fraction.items():
        r = int(rank_fraction * 128)
        factors = 2 * (128 * r + 256 * r) * 4  # P (m×r) and R (n×r) per matrix, fp32
        assert sent == pytest.approx(factors, abs=64), (rank_fraction, sent)  # + the 8-byte verdict
        assert sent < full_gradients


def _householder_fallback_rows(rank: int, world: int) -> dict:
    """fp64, 9 rows over 2 ranks (5 + 4), a full-rank gradient of condition number 1e8: κ²·eps64 > 1e-2,
    so CholeskyQR is not trusted and each rank takes its rows of the Householder QR of the gathered P."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    u = torch.linalg.qr(torch.randn(9, 8, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64)).Q
    g = u @ torch.diag(torch.logspace(0, -8, 8, dtype=torch.float64)) @ v.T
    single = nn.Parameter(init.clone())
    sharded = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))
    opt_single = orthoptim.Dion([single], lr=0.05, rank_fraction=1.0)
    opt_sharded = orthoptim.Dion([sharded], lr=0.05, rank_fraction=1.0, outer_shard_mesh=mesh)
    opt_sharded.comm_stats = CommStats()
    single.grad, sharded.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
    opt_single.step()
    opt_sharded.step()
    update = (single.detach() - init).norm()
    return {"error": float((sharded.full_tensor() - single.detach()).norm() / update),
            "gathers": opt_sharded.comm_stats.calls["all_gather"]}


def test_the_householder_fallback_keeps_each_ranks_own_rows():
    """P gathered whole for the fallback QR: each rank must keep its own rows of Q (rows 5..8 on rank 1),
    not another rank's, or its block of the update is another block's."""
    for rank, result in enumerate(run_distributed(_householder_fallback_rows, 2, timeout=60)):
        assert result["gathers"] == 1, (rank, result)  # the fallback ran
        assert result["error"] <= 1e-9, (rank, result)


def _refusals(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("outer", "inner"))
    messages = []
    twice = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(0), Shard(0)]))
    for params, kwargs in [
        ([twice], {"outer_shard_mesh": mesh["outer"], "inner_shard_mesh": mesh["inner"]}),
        # sharded over a mesh Dion was not told about
        ([nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh["outer"], [Shard(1)]))],
         {"inner_shard_mesh": mesh["inner"]}),
        ([nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh["outer"], [Shard(0)]))], {}),
    ]:
        with pytest.raises(ValueError) as info:
            orthoptim.Dion(params, **kwargs)
        messages.append(str(info.value))
    return messages


def test_unsupported_dion_shardings_are_refused_by_name():
    twice, unknown_mesh, no_mesh = run_distributed(_refusals, 2, timeout=60)[0]
    assert "sharded twice along dim 0" in twice and "Shard(0)" in twice and "#0" in twice
    assert "matches neither outer_shard_mesh nor inner_shard_mesh" in unknown_mesh
    assert "outer_shard_mesh" in no_mesh and "inner_shard_mesh" in no_mesh


def _fp16_replicated_average(rank: int, world: int, algorithm: str) -> dict:
    """fp16 gradients of 40000 on each of 2 ranks: finite, and so is their mean; their sum is not."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(torch.full((4, 6), 0.1, dtype=torch.float16) + torch.eye(4, 6, dtype=torch.float16))
    opt = orthoptim.Dion([{"params": [("w", p)], "algorithm": algorithm}], replicate_mesh=mesh, lr=0.01)
    p.grad = torch.full((4, 6), 40000.0, dtype=torch.float16)
    opt.step()
    return {"grad": p.grad[0, 0].item(), "momentum_finite": bool(torch.isfinite(opt.state[p]["momentum"]).all()),
            "weights_finite": bool(torch.isfinite(p).all())}


@pytest.mark.parametrize("algorithm", ["muon", "dion3"])
def test_fp16_gradients_averaged_over_replicas_do_not_overflow(algorithm):
    for result in run_distributed(_fp16_replicated_average, 2, algorithm, timeout=90):
        assert result == {"grad": 40000.0, "momentum_finite": True, "weights_finite": True}, result


def _replica_dim_placements(rank: int, world: int) -> dict:
    """Over replicate_mesh a Partial gradient is each replica's own (what compressed sync reduces) and
    steps; any other placement there (a Shard(1) bias gradient: 3 and 2 local columns on different
    ranks) was let through too, and gloo aborted on the AdamW average of buffers of unequal sizes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "outer"))
    torch.manual_seed(0)
    x = distribute_tensor(torch.randn(4, 8), mesh, [Shard(0), Replicate()])  # each replica its own batch
    w = nn.Parameter(distribute_tensor(torch.randn(6, 8), mesh, [Replicate(), Shard(0)]))
    (x @ w.mT).pow(2).sum().backward()
    out = {"partial": str(w.grad.placements)}
    opt = orthoptim.Dion([w], lr=0.01, replicate_mesh=mesh["replicate"], outer_shard_mesh=mesh["outer"])
    opt.step()
    b = nn.Parameter(distribute_tensor(torch.randn(4, 5), mesh, [Replicate(), Shard(0)]))
    w.grad = distribute_tensor(torch.randn(6, 8), mesh, [Replicate(), Shard(0)])
    b.grad = distribute_tensor(torch.randn(4, 5), mesh, [Shard(1), Shard(0)])
    opt = orthoptim.Dion([{"params": [w]}, {"params": [b], "algorithm": "adamw"}], lr=0.01,
                         replicate_mesh=mesh["replicate"], outer_shard_mesh=mesh["outer"])
    out["sharded"] = value_error(opt.step)
    return out


def test_over_the_replicate_mesh_only_partial_gradients_pass():
    for result in run_distributed(_replica_dim_placements, 4, timeout=120):
        assert result["partial"].startswith("(Partial(sum)"), result  # and it stepped
        assert "but its gradient (Shard(dim=1), Shard(dim=0))" in result["sharded"], result["sharded"]
