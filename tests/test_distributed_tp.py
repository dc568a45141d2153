"""Column-sharded (tensor-parallel ``Shard(1)``) Dion3 and Dion2 on 2 and 4 real gloo ranks.

Only the selected rows' column blocks travel (two all-to-alls per shape group), row norms and Dion3's
Σ O² are all-reduced, and the result equals one process on the whole matrices: parameters,
momentum and per-row variance, with uneven column shards and a rank that holds no column.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import orthoptim
from orthoptim.distributed import CommStats
from tests.distributed_harness import run_distributed, value_error

REL_TOL = 1e-5
STEPS = 3
# On 4 ranks: 24 columns split 6,6,6,6; 10 split 3,3,3,1; 3 split 1,1,1,0 (one rank holds none).
# Dion2 picks columns of the tall (6, 3) matrix, so that one stays on the gathered path.
SHAPES = [(18, 24), (18, 24), (18, 24), (9, 10), (6, 3)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((_full(a).detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-30))


def _column_sharded(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"errors": {}, "layouts": {}, "calls": {}, "bytes": {}}
    for name, cls, options in [("dion3", orthoptim.Dion3, {"fraction": 0.25}),
                               ("dion2", orthoptim.Dion2, {"fraction": 0.5})]:
        gen = torch.Generator().manual_seed(7)
        init = [torch.randn(s, generator=gen) for s in SHAPES]
        single = [nn.Parameter(t.clone()) for t in init]
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(1)])) for t in init]
        opt_single = cls(single, lr=0.05, weight_decay=0.1, **options)
        opt = cls(sharded, lr=0.05, weight_decay=0.1, distributed_mesh=mesh, **options)
        opt.comm_stats = CommStats()
        for _ in range(STEPS):
            grads = [torch.randn(s, generator=gen) for s in SHAPES]
            for a, b, g in zip(single, sharded, grads):
                a.grad = g.clone()
                b.grad = distribute_tensor(g.clone(), mesh, [Shard(1)])
            opt.comm_stats.reset()
            opt_single.step()
            opt.step()
        errors = []
        for a, b in zip(single, sharded):
            errors.append(_rel(b, a))
            errors.append(_rel(opt.state[b]["momentum"], opt_single.state[a]["momentum"]))
            if name == "dion3":
                errors.append(_rel(opt.state[b]["variance"], opt_single.state[a]["variance"]))
        out["errors"][name] = errors
        out["layouts"][name] = [opt._layout(p, opt.param_groups[0]) for p in sharded]
        out["calls"][name] = dict(opt.comm_stats.calls)
        out["bytes"][name] = dict(opt.comm_stats.bytes)

    # Bytes against the fraction: 4 matrices 64 × 128, one step.
    by_fraction = {}
    for fraction in (1.0, 0.5, 0.25):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(distribute_tensor(torch.randn(64, 128, generator=gen), mesh, [Shard(1)]))
                  for _ in range(4)]
        opt = orthoptim.Dion3(params, fraction=fraction, distributed_mesh=mesh)
        opt.comm_stats = CommStats()
        for p in params:
            p.grad = distribute_tensor(torch.randn(64, 128, generator=gen), mesh, [Shard(1)])
        opt.step()
        by_fraction[fraction] = dict(opt.comm_stats.bytes)
    out["by_fraction"] = by_fraction
    return out


def _check(results: list[dict], world: int) -> None:
    for result in results:
        for name, errors in result["errors"].items():
            assert max(errors) <= REL_TOL, (name, errors)
        assert result["layouts"]["dion3"] == ["column_sharded"] * len(SHAPES)
        assert result["layouts"]["dion2"] == ["column_sharded"] * 4 + ["gathered"]
        # Dion3, one step, 3 shape groups: a row-norm and a Σ O² all-reduce and two all-to-alls each,
        # plus the shared non-finite verdict; nothing is all-gathered.
        assert result["calls"]["dion3"] == {"all_reduce": 3 * 2 + 1, "all_to_all": 3 * 2}
        # Dion2 has no Σ O²; its tall matrix takes the gathered path (all-gathers of M and G).
        calls = result["calls"]["dion2"]
        assert calls["all_reduce"] == 2 + 1 and calls["all_to_all"] == 2 * 2 and calls["all_gather"] >= 1
        by_fraction = result["by_fraction"]
        for fraction in (0.5, 0.25):
            k, k_full = math.ceil(fraction * 64), 64
            # The selected rows' blocks, there and back: exactly proportional to the selected rows.
            assert by_fraction[fraction]["all_to_all"] * k_full == by_fraction[1.0]["all_to_all"] * k
        local_cols = 128 // world
        assert by_fraction[0.25]["all_to_all"] == 2 * 4 * 16 * local_cols * 4  # there and back, fp32


def test_column_sharded_dion3_dion2_on_2_ranks():
    _check(run_distributed(_column_sharded, 2, timeout=180), 2)


def test_column_sharded_dion3_dion2_on_4_ranks():
    _check(run_distributed(_column_sharded, 4, timeout=240), 4)


def _gradients_in_other_placements(rank: int, world: int) -> dict:
    """Replicated weights under a batch-sharded input get Partial(sum) gradients from DTensor autograd
    (sequence parallelism's norms, for one); a row-sharded weight can be handed a column-sharded
    gradient. Each rank's block of such a gradient is not the block the step reads: the step used
    partial sums (AdamW replicas drifted apart) and misread the columns. Now refused on every rank,
    before anything changes; laid out as the parameters, the step is one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    w0, b0, x0 = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen), torch.randn(9, 6, generator=gen)
    v0, gv = torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen)

    def groups(w, b, v):
        return [{"params": [w], "algorithm": "muon"}, {"params": [b], "algorithm": "adamw"},
                {"params": [v], "algorithm": "dion3", "fraction": 0.5}]

    w = nn.Parameter(distribute_tensor(w0.clone(), mesh, [Replicate()]))
    b = nn.Parameter(distribute_tensor(b0.clone(), mesh, [Replicate()]))
    v = nn.Parameter(distribute_tensor(v0.clone(), mesh, [Shard(0)]))
    ((distribute_tensor(x0, mesh, [Shard(0)]) @ w + b) ** 2).sum().backward()
    result = {"partial": str(w.grad.placements)}
    opt = orthoptim.Dion3(groups(w, b, v), lr=0.1, distributed_mesh=mesh)
    v.grad = distribute_tensor(gv.clone(), mesh, [Shard(0)])
    result["partial_error"] = value_error(opt.step)
    for p in (w, b):
        p.grad = p.grad.redistribute(mesh, p.placements)
    v.grad = distribute_tensor(gv.clone(), mesh, [Shard(1)])
    result["column_error"] = value_error(opt.step)
    result["unchanged"] = bool(torch.equal(w.to_local(), w0) and torch.equal(v.full_tensor(), v0))
    v.grad = v.grad.redistribute(mesh, v.placements)
    opt.step()
    ws, bs, vs = nn.Parameter(w0.clone()), nn.Parameter(b0.clone()), nn.Parameter(v0.clone())
    ((x0 @ ws + bs) ** 2).sum().backward()
    vs.grad = gv.clone()
    orthoptim.Dion3(groups(ws, bs, vs), lr=0.1).step()
    result.update(w=_rel(w.to_local(), ws), b=_rel(b.to_local(), bs), v=_rel(_full(v), vs))
    v.grad = gv.clone()  # a plain tensor
    result["plain"] = value_error(opt.step)
    return result


def test_gradients_in_other_placements_are_refused_on_every_rank():
    for result in run_distributed(_gradients_in_other_placements, 3, timeout=120):
        assert "Partial" in result["partial"]  # what the case is about
        assert "(Replicate(),) but its gradient (Partial(sum),)" in result["partial_error"], result["partial_error"]
        assert "p.grad.redistribute(p.device_mesh, p.placements)" in result["partial_error"]
        assert "(Shard(dim=0),) but its gradient (Shard(dim=1),)" in result["column_error"], result["column_error"]
        assert result["unchanged"]
        assert max(result["w"], result["b"], result["v"]) <= 1e-6, result
        assert "is a DTensor but its gradient is a plain tensor" in result["plain"], result["plain"]


def _pipeline_stages(rank: int, world: int) -> dict:
    """Pipeline × tensor parallelism, as torchtitan lays it out: a (pp=2, dp=1, tp=2) mesh, one optimizer
    per stage over its own tensor-parallel matrices, distributed_mesh=mesh["dp"]. The step's verdict
    was reduced over the whole world, across stages: stage 0's table (3 matrices) met stage 1's (2)
    and gloo aborted; with equal counts, stage 0's NaN skipped stage 1's finite matrix. Now each stage
    agrees over its own mesh: it skips only its own NaN and equals one process on whole matrices."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage = mesh.get_local_rank("pp")
    sub = mesh["dp", "tp"]
    shapes = [(8, 12), (8, 12), (6, 10)] if stage == 0 else [(8, 12), (8, 12)]
    gen = torch.Generator().manual_seed(stage)
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    if stage == 0:
        grads[0][0, 0] = float("nan")
    out = {"stage": stage}
    for cls in (orthoptim.Muon, orthoptim.Dion3):
        sharded = [nn.Parameter(distribute_tensor(t.clone(), sub, [Replicate(), Shard(1)])) for t in init]
        single = [nn.Parameter(t.clone()) for t in init]
        opt = cls(sharded, lr=0.05, nonfinite="skip", distributed_mesh=mesh["dp"])
        opt_single = cls(single, lr=0.05, nonfinite="skip")
        for a, b, g in zip(single, sharded, grads):
            a.grad, b.grad = g.clone(), distribute_tensor(g.clone(), sub, b.placements)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
            opt_single.step()
        out[cls.__name__] = {"skipped": sum("skipped" in str(w.message) for w in caught),
                             "changed": [not torch.equal(_full(b), t) for b, t in zip(sharded, init)],
                             "error": max(_rel(b, a) for a, b in zip(single, sharded))}
    return out


def test_pipeline_stages_agree_over_their_own_meshes():
    for result in run_distributed(_pipeline_stages, 4, timeout=180):
        for name in ("Muon", "Dion3"):
            got = result[name]
            if result["stage"] == 0:  # one skip warned by each of the two optimizers
                assert got["skipped"] == 2 and got["changed"] == [False, True, True], (name, got)
            else:
                assert got["skipped"] == 0 and got["changed"] == [True, True], (name, got)
            assert got["error"] <= REL_TOL, (name, got)
