"""Row-sharded parameters (FSDP2 Shard(0) DTensors) on 2 and 4 real gloo ranks: the same updates as one
process, two all-to-alls per shape group, Dion3 bytes that scale with the fraction, clear errors for
layouts this version does not run."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
from torch import nn

import orthoptim
from orthoptim.distributed import CommStats
from tests.distributed_harness import needs_cpu_hsdp, run_distributed, value_error

REL_TOL = 1e-5  # fp32 Newton-Schulz: same math, different batch composition on the owner rank
STEPS = 3
LR, WD, MU, BETA2, EPS = 0.05, 0.1, 0.95, 0.95, 1e-8

# Uneven (18 rows on 4 ranks: 5,5,5,3), an empty shard (3 rows on 4 ranks), 3 same-shape matrices
# (a megabatch that does not divide the world size), wide and tall.
SHAPES = [(18, 24), (18, 24), (18, 24), (3, 20), (40, 16)]


def _exact_polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    return (u @ vh).to(x.dtype)


def _init(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _sharded_run(cls, mesh, steps: int = STEPS, **kwargs):
    from torch.distributed.tensor import Shard, distribute_tensor

    params = [nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in _init()]
    opt = cls(params, lr=LR, weight_decay=WD, distributed_mesh=mesh, **kwargs)
    stats = CommStats()
    opt.comm_stats = stats
    comm = []
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        stats.reset()
        opt.step()
        comm.append(stats.as_dict())
    return [p.full_tensor() for p in params], opt, comm


def _single_run(cls, steps: int = STEPS, **kwargs):
    params = [nn.Parameter(t) for t in _init()]
    opt = cls(params, lr=LR, weight_decay=WD, **kwargs)
    for step in range(steps):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in params]


def _shard_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """torch.chunk-style row ranges, written out independently of the library."""
    size = -(-rows // world)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]


def _dion3_local_selection_reference(world: int, fraction: float, steps: int = STEPS) -> list[torch.Tensor]:
    """Dion3 with per-shard top-k selection, per matrix, float64, from the equations."""
    xs = [t.double() for t in _init()]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros(x.shape[0], dtype=torch.float64) for x in xs]
    for step in range(steps):
        for x, m, v, g in zip(xs, ms, vs, _grads(step)):
            rows, cols = x.shape
            m += g.double()
            selected = []
            for lo, hi in _shard_ranges(rows, world):
                if hi > lo:
                    k = math.ceil(fraction * (hi - lo))
                    selected.append(torch.topk(m[lo:hi].abs().sum(1), k).indices + lo)
            s = torch.cat(selected)
            u = m[s].clone()
            m[s] *= MU
            o = _exact_polar(u)
            v[s] = BETA2 * v[s] + (1 - BETA2) * (o**2).mean(1)
            o_hat = o / (v[s].sqrt() + EPS)[:, None]
            o_hat = o_hat * (o.norm() / (o_hat.norm() + EPS))
            x *= 1 - LR * WD
            x[s] -= LR * math.sqrt(rows / cols) * o_hat
    return xs


def _parity(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    cases = {
        "muon": (orthoptim.Muon, {"nesterov": True}),
        "normuon": (orthoptim.NorMuon, {}),
        "dion3_f1": (orthoptim.Dion3, {"fraction": 1.0}),  # every row selected: equals one process
        "dion2_f1": (orthoptim.Dion2, {"fraction": 1.0}),
        # Exact global selection: the same rows as one process, so the same update.
        "dion3_global": (orthoptim.Dion3, {"fraction": 0.25, "selection_scope": "global"}),
        "dion2_global": (orthoptim.Dion2, {"fraction": 0.3, "selection_scope": "global"}),
    }
    for name, (cls, kwargs) in cases.items():
        got, _, comm = _sharded_run(cls, mesh, **kwargs)
        want = _single_run(cls, **kwargs)
        errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]
        if name == "dion2_global":
            # One process slices a tall matrix by columns; row sharding makes Dion2 select rows there.
            errors = [e for e, shape in zip(errors, SHAPES) if shape[0] <= shape[1]]
        out[name] = {"errors": errors, "comm": comm}

    for fraction in (0.5, 0.25):
        got, opt, comm = _sharded_run(orthoptim.Dion3, mesh, fraction=fraction, orthogonalizer=_exact_polar)
        want = _dion3_local_selection_reference(world, fraction)
        out[f"dion3_local_{fraction}"] = {
            "errors": [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want)], "comm": comm}
        variance = opt.state[opt.param_groups[0]["params"][0]]["variance"]
        out[f"dion3_local_{fraction}"]["variance_type"] = type(variance).__name__
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_row_sharded_parameters_match_single_process(world_size):
    results = run_distributed(_parity, world_size, timeout=240)
    shape_groups = 3  # (18, 24) x3, (3, 20), (40, 16)
    for rank, result in enumerate(results):
        for name, rec in result.items():
            tol = 1e-9 if name.startswith("dion3_local") else REL_TOL  # exact polar factor vs float64 reference
            tol = max(tol, 1e-6)  # fp32 parameters
            assert max(rec["errors"]) <= tol, (rank, name, rec["errors"])
            for step in rec["comm"]:
                assert step["all_to_all"]["calls"] == 2 * shape_groups, (name, step)
                assert step["all_reduce"]["calls"] == 1  # the shared non-finite verdict
                # Global selection adds one all-gather of row norms per shape group, nothing else.
                assert step.get("all_gather", {}).get("calls", 0) == (shape_groups if "global" in name else 0)
    assert results[0]["dion3_local_0.5"]["variance_type"] == "DTensor"


def _shapes_whose_shards_coincide(rank: int, world: int) -> dict:
    """[10, 16] and [9, 16] on 2 ranks: shards [5, 16] and [5, 16] on rank 0, [5, 16] and [4, 16] on rank 1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, cls, kwargs in (("muon", orthoptim.Muon, {}),
                              ("dion3_global", orthoptim.Dion3, {"selection_scope": "global"})):
        gen = torch.Generator().manual_seed(0)
        init = [torch.randn(shape, generator=gen) for shape in ((10, 16), (9, 16))]
        grads = [torch.randn(t.shape, generator=gen) for t in init]
        single = [nn.Parameter(t.clone()) for t in init]
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
        opt_single = cls(single, lr=LR, **kwargs)
        opt_sharded = cls(sharded, lr=LR, distributed_mesh=mesh, **kwargs)
        for a, b, g in zip(single, sharded, grads):
            a.grad, b.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
        opt_single.step()
        opt_sharded.step()
        out[name] = [float((b.full_tensor() - a.detach()).norm() / a.detach().norm()) for a, b in zip(single, sharded)]
    return out


def test_megabatches_are_keyed_by_the_full_shape_on_every_rank():
    """Keyed by the local shape, rank 0 would batch both matrices together and rank 1 apart: the ranks'
    exchanges no longer match (wrong rows, or a collective of another size)."""
    for rank, result in enumerate(run_distributed(_shapes_whose_shards_coincide, 2, timeout=60)):
        for name, errors in result.items():
            assert max(errors) <= REL_TOL, (rank, name, errors)


def _empty_last_shard(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name, cls, kwargs in (("muon", orthoptim.Muon, {}),
                              ("dion3_global", orthoptim.Dion3, {"selection_scope": "global", "fraction": 0.5})):
        gen = torch.Generator().manual_seed(0)
        init, g = torch.randn(5, 8, generator=gen), torch.randn(5, 8, generator=gen)
        single = nn.Parameter(init.clone())
        sharded = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))
        opt_single = cls([single], lr=LR, **kwargs)
        opt_sharded = cls([sharded], lr=LR, distributed_mesh=mesh, **kwargs)
        single.grad, sharded.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
        opt_single.step()
        opt_sharded.step()
        out[name] = float((sharded.full_tensor() - single.detach()).norm() / (single.detach() - init).norm())
    return out


def test_an_empty_last_shard_after_a_short_one_matches_single_process():
    """5 rows on 4 ranks: torch.chunk gives 2, 2, 1, 0 (5 - 3·2 < 0 rows left for the last rank, held as
    0, not -1). Muon and Dion3 with global selection equal one process."""
    from orthoptim.distributed.dtensor import shard_rows

    assert shard_rows(5, 4) == [2, 2, 1, 0]
    assert shard_rows(5, 4) == [hi - lo for lo, hi in _shard_ranges(5, 4)]
    for rank, result in enumerate(run_distributed(_empty_last_shard, 4, timeout=90)):
        for name, error in result.items():
            assert error <= REL_TOL, (rank, name, error)


def _bytes_by_fraction(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for fraction in (1.0, 0.5, 0.25, 0.125):
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(distribute_tensor(torch.randn(256, 128, generator=gen), mesh, [Shard(0)]))
                  for _ in range(4)]
        opt = orthoptim.Dion3(params, fraction=fraction, distributed_mesh=mesh)
        opt.comm_stats = CommStats()
        for p in params:
            p.grad = distribute_tensor(torch.randn(256, 128, generator=gen), mesh, [Shard(0)])
        opt.step()
        out[fraction] = opt.comm_stats.bytes["all_to_all"]
    return out


def test_dion3_communicated_bytes_scale_with_fraction():
    results = run_distributed(_bytes_by_fraction, 2, timeout=120)
    for by_fraction in results:
        full = by_fraction[1.0]
        for fraction in (0.5, 0.25, 0.125):
            # Rows plus one packed fp32 variance column per row: exactly proportional to selected rows.
            assert by_fraction[fraction] == pytest.approx(full * fraction, rel=0.02), by_fraction


def _gathered_layouts(rank: int, world: int) -> dict:
    """Sharding other than rows over distributed_mesh: Shard(1) (tensor-parallel rowwise), FSDP x TP on a
    2-D mesh, and per-head blocks of a row-sharded matrix: whole matrices are gathered, the same update."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh_1d = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    layouts = {
        "shard1": (mesh_1d, [Shard(1)], mesh_1d, {}),
        "fsdp_x_tp": (mesh_2d, [Shard(0), Shard(1)], mesh_2d["dp"], {}),
        "fsdp_x_tp_rows": (mesh_2d, [Shard(0), Shard(0)], mesh_2d["dp"], {}),
        "heads": (mesh_1d, [Shard(0)], mesh_1d, {"num_heads": 3}),
    }
    optimizers = {
        "muon": (orthoptim.Muon, {"nesterov": True}),
        "normuon": (orthoptim.NorMuon, {}),
        "dion3": (orthoptim.Dion3, {"fraction": 0.25}),
        "dion2": (orthoptim.Dion2, {"fraction": 0.5}),
        "dion": (orthoptim.Dion3, {"algorithm": "dion", "rank_fraction": 0.5}),
    }
    shapes = [(18, 24), (18, 24), (24, 12)]
    out = {}
    for layout, (mesh, placements, opt_mesh, group_options) in layouts.items():
        for name, (cls, options) in optimizers.items():
            if name == "dion" and layout.startswith("fsdp_x_tp"):
                continue  # Dion factors such matrices with its own meshes: tests/test_distributed_dion.py
            options = {**options, **group_options}
            group_keys = {k: options.pop(k) for k in ("algorithm", "rank_fraction", "num_heads") if k in options}
            gen = torch.Generator().manual_seed(3)
            init = [torch.randn(s, generator=gen) for s in shapes]
            grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
            single = [nn.Parameter(t.clone()) for t in init]
            sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, placements)) for t in init]
            opt_single = cls([{"params": single, **group_keys}], lr=LR, weight_decay=WD, **options)
            opt = cls([{"params": sharded, **group_keys}], lr=LR, weight_decay=WD, distributed_mesh=opt_mesh,
                      **options)
            for step in range(STEPS):
                for a, b, g in zip(single, sharded, grads[step]):
                    a.grad = g.clone()
                    b.grad = distribute_tensor(g.clone(), mesh, placements)
                opt_single.step()
                opt.step()
            out[(layout, name)] = [float((b.full_tensor() - a).norm() / a.norm()) for a, b in zip(single, sharded)]
    return out


def test_gathered_layouts_match_single_process():
    for result in run_distributed(_gathered_layouts, 4, timeout=300):
        for key, errors in result.items():
            assert max(errors) <= REL_TOL, (key, errors)


def _gathered_bf16(rank: int, world: int) -> dict:
    """bf16 matrices sharded by columns (gathered whole for the update), one step with lr·wd below
    2⁻⁹: the update collected in fp32 and added with the decay in one rounding, as on one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.reference_rules import polar

    def bf16_polar(x: torch.Tensor) -> torch.Tensor:  # the same on every rank, whatever the batch
        return torch.stack([polar(a) for a in x]).to(torch.bfloat16).to(x.dtype)

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in ("muon", "normuon", "dion3", "dion2"):
        gen = torch.Generator().manual_seed(5)
        init = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in [(16, 24), (24, 16)]]
        grads = [torch.randn(t.shape, generator=gen).to(torch.bfloat16) for t in init]
        single = [nn.Parameter(t.clone()) for t in init]
        sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(1)])) for t in init]
        options = dict(algorithm=name, orthogonalizer=bf16_polar, fraction=0.5)
        opt_single = orthoptim.Dion3([{"params": single, **options}], lr=0.01, weight_decay=0.1)
        opt = orthoptim.Dion3([{"params": sharded, **options}], lr=0.01, weight_decay=0.1, distributed_mesh=mesh)
        for a, b, g in zip(single, sharded, grads):
            a.grad, b.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(1)])
        opt_single.step()
        opt.step()
        out[name] = [float((b.full_tensor() != a).float().mean()) for a, b in zip(single, sharded)]
    return out


def test_gathered_bf16_matrices_round_once_like_one_process():
    # The fp32 sums may differ in their last bit (Dion3's update adds c·O to the decayed rows in one
    # addcmul on one process), which flips the rounding of an entry now and then; a decay rounded
    # on its own changes most of them.
    for result in run_distributed(_gathered_bf16, 2, timeout=120):
        for name, mismatched in result.items():
            assert max(mismatched) <= 0.01, (name, mismatched)


def _bf16_row_shards_of_odd_width(rank: int, world: int) -> dict:
    """bf16 rows sharded by rows, odd widths, a rank holding one row: the fp32 variance rides back as
    pairs of bf16 columns, and one row of an odd width started mid-fp32 (view() refused it on that rank
    only, and the others waited in the second all-to-all or stepped alone)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tests.reference_rules import polar

    def bf16_polar(x: torch.Tensor) -> torch.Tensor:  # the same on every rank, whatever the batch
        return torch.stack([polar(a) for a in x]).to(torch.bfloat16).to(x.dtype)

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    cases = (("normuon", (3, 5), {}), ("dion3", (5, 7), {"fraction": 0.5, "selection_scope": "global"}),
             ("dion3", (16, 27), {"fraction": 0.01, "selection_scope": "global"}))
    for name, shape, options in cases:
        gen = torch.Generator().manual_seed(6)
        init = torch.randn(shape, generator=gen).to(torch.bfloat16)
        single = nn.Parameter(init.clone())
        sharded = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))
        group = dict(algorithm=name, orthogonalizer=bf16_polar, **options)
        opt_single = orthoptim.Dion3([{"params": [single], **group}], lr=0.01)
        opt = orthoptim.Dion3([{"params": [sharded], **group}], lr=0.01, distributed_mesh=mesh)
        for _ in range(2):
            g = torch.randn(shape, generator=gen).to(torch.bfloat16)
            single.grad, sharded.grad = g.clone(), distribute_tensor(g.clone(), mesh, [Shard(0)])
            opt_single.step()
            opt.step()
        variance = opt.state[sharded]["variance"]
        variance = variance.full_tensor() if hasattr(variance, "full_tensor") else variance
        ulp = 2.0 ** (torch.frexp(single.detach().float()).exponent - 8)  # bf16's spacing at each entry
        out[f"{name} {shape}"] = (float(((sharded.full_tensor() - single).float().abs() / ulp).max()),
                                  float((variance != opt_single.state[single]["variance"]).float().mean()))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_row_shards_of_odd_width_match_one_process(world):
    # Ô travels back from the rows' owner in bf16: an entry may round one ulp the other way, where one
    # process keeps Ô in fp32 (a layout mix-up moves entries by many ulps). The variance is exact.
    for result in run_distributed(_bf16_row_shards_of_odd_width, world, timeout=120):
        for key, (ulps, variance) in result.items():
            assert ulps <= 1.0 and variance <= 0.01, (key, ulps, variance)


def _without_mesh(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    p = nn.Parameter(distribute_tensor(torch.randn(8, 12), init_device_mesh("cpu", (world,)), [Shard(0)]))
    return value_error(lambda: orthoptim.Dion3([{"params": [("blocks.0.attn.weight", p)]}]))


def _transposed_row_shards(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.randn(8, 12), mesh, [Shard(0)]))
    return value_error(lambda: orthoptim.Muon([{"params": [("h.0.mlp.c_fc.weight", p)], "transpose": True}],
                                                      distributed_mesh=mesh))


def test_a_transposed_matrix_on_row_shards_is_refused():
    for message in run_distributed(_transposed_row_shards, 2, timeout=60):
        assert "h.0.mlp.c_fc.weight" in message and "transpose=True runs on whole matrices only" in message, message


def test_sharded_parameter_without_mesh_is_refused():
    message = run_distributed(_without_mesh, 2, timeout=60)[0]
    assert "blocks.0.attn.weight" in message and "Shard(dim=0)" in message and "distributed_mesh" in message


def _mesh_out_of_order(rank: int, world: int, name: str, dim: int) -> str:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh("cpu", [1, 0] if world == 2 else [0, 2, 1, 3])  # on 4 ranks, 0 and 3 are in place
    torch.manual_seed(0)
    p = nn.Parameter(distribute_tensor(torch.randn(3, 8) if dim == 0 else torch.randn(8, 3), mesh, [Shard(dim)]))
    cls = {"dion3": orthoptim.Dion3, "muon": orthoptim.Muon, "dion": orthoptim.Dion}[name]
    return value_error(lambda: cls([{"params": [("blocks.0.attn.weight", p)]}], distributed_mesh=mesh))


@pytest.mark.parametrize(("name", "dim", "world"), [("dion3", 1, 2), ("muon", 0, 2), ("dion", 0, 2), ("dion3", 0, 4)])
def test_a_mesh_listing_its_ranks_out_of_order_is_refused_on_every_rank(name, dim, world):
    """DTensor gives block i to the mesh's i-th rank, the exchanges to the process group's: with the
    order reversed a column-sharded Dion3 step failed on one rank and hung another, row shards were
    assembled permuted or refused as "not torch.chunk-style"."""
    for rank, message in enumerate(run_distributed(_mesh_out_of_order, world, name, dim, timeout=60)):
        if world == 4 and rank in (0, 3):
            assert "another rank's error names it" in message and "ascending order" in message, message
        else:
            assert "blocks.0.attn.weight" in message and "ascending order" in message, message


def _wrong_sub_mesh(rank: int, world: int) -> str:
    """HSDP rows sharded over mesh['shard'], but the optimizer given mesh['replicate'] (the same size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    p = nn.Parameter(distribute_tensor(torch.randn(8, 12), mesh, [Replicate(), Shard(0)]))
    return value_error(lambda: orthoptim.Muon([{"params": [("blocks.0.attn.weight", p)]}],
                                                      distributed_mesh=mesh["replicate"]))


def test_rows_sharded_over_another_sub_mesh_of_the_same_size_are_refused():
    """The row exchange would have assembled rows from replicas: updates 39 % off, silently."""
    for message in run_distributed(_wrong_sub_mesh, 4, timeout=60):
        assert "blocks.0.attn.weight" in message and "sharded over ranks" in message, message
        assert "mesh['shard']" in message, message


def _sum_where_avg_is_asked() -> None:
    """Make this process's reduce-scatters sum when asked to average, as gloo's did on torch 2.7 and
    2.8 (FSDP2 calls them through the ``torch.distributed`` module: ``reduce_scatter_tensor`` or, on
    newer torch, ``reduce_scatter_single``)."""
    import inspect

    import torch.distributed as dist

    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        real = getattr(dist, name, None)
        if real is None:
            continue
        signature = inspect.signature(real)

        def summing(*args, _real=real, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            if bound.arguments.get("op") == dist.ReduceOp.AVG:
                bound.arguments["op"] = dist.ReduceOp.SUM
            return _real(*bound.args, **bound.kwargs)

        setattr(dist, name, summing)


def _fully_shard_training(rank: int, world: int, summing_gloo: bool) -> dict:
    """A real FSDP2 model, sharded with ``fully_shard_options``: each rank trains on its slice; equals
    one process on the whole batch, its gradients too (Muon alone would not see gradients off by a
    constant factor). ``summing_gloo``: reduce-scatters sum where asked to average, as on torch 2.7
    and 2.8, so that the options' workaround is exercised on every torch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orthoptim.train.loop import fully_shard_options

    if summing_gloo:
        _sum_where_avg_is_asked()
    mesh = init_device_mesh("cpu", (world,))
    options = fully_shard_options(mesh)
    torch.manual_seed(0)
    data, target = torch.randn(8 * world, 16), torch.randn(8 * world, 4)

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(16, 18), nn.Tanh(), nn.Linear(18, 18), nn.Tanh(), nn.Linear(18, 4))

    single = model()
    opt_single = orthoptim.Muon(orthoptim.param_groups(single), lr=0.02)
    sharded = model()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(sharded, mesh=mesh, **options)
    opt_sharded = orthoptim.Muon(orthoptim.param_groups(sharded), lr=0.02, distributed_mesh=mesh)
    lo, hi = rank * 8, (rank + 1) * 8
    grad_errors = []
    for _ in range(3):
        nn.functional.mse_loss(single(data), target).backward()
        nn.functional.mse_loss(sharded(data[lo:hi]), target[lo:hi]).backward()
        grad_errors += [float((a.grad.full_tensor() - b.grad).norm() / b.grad.norm())
                        for a, b in zip(sharded.parameters(), single.parameters())]
        opt_single.step()
        opt_single.zero_grad()
        opt_sharded.step()
        opt_sharded.zero_grad()
    return {"errors": [float((a.full_tensor() - b).norm() / b.norm())
                       for a, b in zip(sharded.parameters(), single.parameters())],
            "grad_errors": grad_errors, "options": sorted(options)}


@pytest.mark.parametrize("summing_gloo", [False, True], ids=["gloo", "gloo-summing-avg"])
def test_fully_shard_model_matches_single_process(summing_gloo):
    # gloo's own reduce-scatter sums where asked to average before torch 2.9: the options are then needed too
    needed = summing_gloo or torch.__version__ < "2.9"
    for rec in run_distributed(partial(_fully_shard_training, summing_gloo=summing_gloo), 2, timeout=120):
        assert rec["options"] == (["mp_policy"] if needed else []), rec["options"]
        assert max(rec["errors"]) <= 1e-4, rec["errors"]  # reduce-scatter averaging reorders sums
        assert max(rec["grad_errors"]) <= 1e-5, rec["grad_errors"]


def _hsdp_training(rank: int, world: int) -> dict:
    """HSDP: FSDP2 on a (replicate, shard) mesh, the optimizer on the shard sub-mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orthoptim.train.loop import fully_shard_options

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    options = fully_shard_options(mesh)
    torch.manual_seed(0)
    data, target = torch.randn(8 * world, 16), torch.randn(8 * world, 4)

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(16, 18), nn.Tanh(), nn.Linear(18, 18), nn.Tanh(), nn.Linear(18, 4))

    results = {}
    for name, make in (("dion3", lambda g, **kw: orthoptim.Dion3(g, lr=0.02, fraction=0.5,
                                                                  selection_scope="global", **kw)),
                       ("normuon", lambda g, **kw: orthoptim.NorMuon(g, lr=0.02, **kw))):
        single = model()
        opt_single = make(orthoptim.param_groups(single))
        sharded = model()
        for layer in sharded:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **options)
        fully_shard(sharded, mesh=mesh, **options)
        opt = make(orthoptim.param_groups(sharded), distributed_mesh=mesh["shard"])
        lo, hi = rank * 8, (rank + 1) * 8
        shard_rank = mesh["shard"].get_local_rank()
        for _ in range(3):
            nn.functional.mse_loss(single(data), target).backward()
            opt_single.step()
            opt_single.zero_grad()
            nn.functional.mse_loss(sharded(data[lo:hi]), target[lo:hi]).backward()
            opt.step()
            opt.zero_grad()
        errors = [float((a.full_tensor() - b).norm() / b.norm()) for a, b in zip(sharded.parameters(),
                                                                                single.parameters())]
        results[name] = {"errors": errors, "shard_rank": shard_rank}
    return results


@needs_cpu_hsdp
def test_hsdp_matches_single_process():
    for rec in run_distributed(_hsdp_training, 4, timeout=180):
        for name in ("normuon", "dion3"):  # Dion3 with exact global selection picks one process's rows
            assert max(rec[name]["errors"]) <= 1e-4, (name, rec[name])  # gradient averaging reorders sums


def _expert_batches(rank: int, world: int) -> dict:
    """3-D batches of matrices sharded by matrix (Shard(0), the "local" layout: each rank updates whole
    experts): 5 experts on 2 ranks (3 + 2), 1 expert (a rank holds none), and per-head blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(5, 6, 8), (1, 6, 8)]
    optimizers = {
        "muon": (orthoptim.Muon, {}), "normuon": (orthoptim.NorMuon, {}), "dion3": (orthoptim.Dion3, {}),
        "dion2": (orthoptim.Dion2, {"fraction": 0.5}), "dion": (orthoptim.Dion, {"rank_fraction": 0.5}),
    }
    out = {}
    for heads, transpose in ((None, False), (2, False), (None, True)):  # transpose: experts stored [E, in, out]
        for name, (cls, options) in optimizers.items():
            gen = torch.Generator().manual_seed(5)
            init = [torch.randn(s, generator=gen) for s in shapes]
            grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(STEPS)]
            single = [nn.Parameter(t.clone()) for t in init]
            sharded = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
            group = {"num_heads": heads, "transpose": transpose}
            opt_single = cls([{"params": single, **group}], lr=LR, weight_decay=WD, **options)
            opt = cls([{"params": sharded, **group}], lr=LR, weight_decay=WD, distributed_mesh=mesh, **options)
            for step in range(STEPS):
                for a, b, g in zip(single, sharded, grads[step]):
                    a.grad = g.clone()
                    b.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
                opt_single.step()
                opt.step()
            rec = {"errors": [float((b.full_tensor() - a).norm() / a.norm()) for a, b in zip(single, sharded)],
                   "layouts": [opt._layout(p, opt.param_groups[0]) for p in sharded]}
            if name == "dion":  # the right factors: whole and the same on every rank, as on one process
                rec["q_error"] = max(float((opt.state[b]["Q"] - opt_single.state[a]["Q"]).abs().max())
                                     for a, b in zip(single, sharded))
            out[(heads, transpose, name)] = rec
    return out


def test_expert_batches_sharded_by_matrix_match_single_process():
    for result in run_distributed(_expert_batches, 2, timeout=240):
        for key, rec in result.items():
            assert rec["layouts"] == ["local", "local"], key
            assert max(rec["errors"]) <= REL_TOL, (key, rec["errors"])
            assert rec.get("q_error", 0.0) <= 1e-6, (key, rec["q_error"])


def _no_eps_polar(x: torch.Tensor) -> torch.Tensor:
    """A user's orthogonalizer that divides by the norm without an eps: NaN on a zero matrix."""
    return _exact_polar(x / x.norm(dim=(-2, -1), keepdim=True))


def _bad_shape(x: torch.Tensor) -> torch.Tensor:
    return x[..., :-1]


def _user_orthogonalizer_failures(rank: int, world: int) -> dict:
    """DDP pads a batch that does not divide the world; FSDP runs the orthogonalizer on the rows' owner
    only. A failure there raised on one rank while the others waited in a collective."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    out = {}
    params = [nn.Parameter(t) for t in _init()[:3]]  # 3 same-shape matrices on 2 ranks: one padded entry
    opt = orthoptim.Muon(params, orthogonalizer=_no_eps_polar, distributed_mesh=torch.distributed.group.WORLD)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    out["ddp_padding"] = all(bool(torch.isfinite(p).all()) for p in params)
    mesh = init_device_mesh("cpu", (world,))
    for capturable in (False, True):  # eager capturable steps agree too (only a CUDA capture cannot)
        sharded = nn.Parameter(distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)]))
        opt = orthoptim.Muon([("w", sharded)], orthogonalizer=_bad_shape, distributed_mesh=mesh,
                             capturable=capturable)
        sharded.grad = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        out[("fsdp_owner", capturable)] = value_error(opt.step)
    return out


def test_a_failing_user_orthogonalizer_raises_on_every_rank_without_hanging():
    results = run_distributed(_user_orthogonalizer_failures, 2, timeout=90)
    for capturable in (False, True):
        for result in results:
            assert result["ddp_padding"], result
            assert "zero update" in result[("fsdp_owner", capturable)], result
        assert any("returned (1, 8, 15)" in r[("fsdp_owner", capturable)] and "['w']" in r[("fsdp_owner", capturable)]
                   for r in results), results


def _fp16_sharded_batches(rank: int, world: int) -> dict:
    """fp16 Dion on [2, 64, 64] batches sharded by matrix, by rows or by columns: the overflow check
    bounds the whole matrices' norms (8800 here), far below fp16's 65504, so nothing is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dim in (0, 1, 2):
        p = nn.Parameter(distribute_tensor(torch.zeros(2, 64, 64, dtype=torch.float16), mesh, [Shard(dim)]))
        opt = orthoptim.Dion([("experts", p)], rank_fraction=0.25, distributed_mesh=mesh)
        p.grad = distribute_tensor(torch.full((2, 64, 64), 1100.0, dtype=torch.float16), mesh, [Shard(dim)])
        try:
            opt.step()
            out[dim] = bool(torch.isfinite(p.full_tensor()).all())
        except orthoptim.NonFiniteGradientError as e:
            out[dim] = str(e)
    return out


def test_fp16_overflow_check_of_sharded_batches_has_no_false_alarm():
    for result in run_distributed(_fp16_sharded_batches, 2, timeout=90):
        assert result == {0: True, 1: True, 2: True}, result


def _nan_in_one_shard(rank: int, world: int) -> dict:
    """A NaN in rank 1's rows of a Shard(0) Dion3 matrix only; another matrix is finite everywhere."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for mode in ("skip", "raise"):  # skip first: a rank that stepped under "raise" would hang the next case
        w = nn.Parameter(distribute_tensor(torch.ones(8, 16), mesh, [Shard(0)]))
        v = nn.Parameter(distribute_tensor(torch.ones(4, 16), mesh, [Shard(0)]))
        opt = orthoptim.Dion3([{"params": [w, v], "param_names": ["w", "v"], "nonfinite": mode}], lr=0.1,
                              distributed_mesh=mesh)
        g = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
        g[7, 0] = float("nan")  # row 7 lives on rank 1
        w.grad = distribute_tensor(g, mesh, [Shard(0)])
        v.grad = distribute_tensor(torch.ones(4, 16), mesh, [Shard(0)])
        state = [t.to_local().clone() for t in opt.state[w].values()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
                out[mode] = "stepped"
            except Exception as e:
                out[mode] = f"{type(e).__name__}: {e}"
        out[mode + "_warnings"] = [str(x.message) for x in caught if "skipped" in str(x.message)]
        out[mode + "_w_unchanged"] = bool((w.to_local() == 1).all()) and all(
            torch.equal(a, b.to_local()) for a, b in zip(state, opt.state[w].values()))
        out[mode + "_v_stepped"] = not bool((v.to_local() == 1).all())
    return out


def test_a_nan_in_one_ranks_shard_is_refused_or_skipped_on_every_rank():
    """Only rank 1 sees the NaN: the verdict is all-reduced, so every rank raises (or skips that
    parameter) together, for the reason rank 1 found. A rank going by its own shard's verdict steps
    into collectives the others never join (a hang); a mixed-up table calls the NaN an fp16 overflow."""
    for rank, result in enumerate(run_distributed(_nan_in_one_shard, 2, timeout=60)):
        raised = result["raise"]
        assert raised.startswith("NonFiniteGradientError: parameter w has a non-finite gradient"), (rank, raised)
        assert "overflow" not in raised, (rank, raised)
        assert result["raise_w_unchanged"], rank
        assert result["skip"] == "stepped", (rank, result["skip"])
        assert len(result["skip_warnings"]) == 1, (rank, result["skip_warnings"])
        assert "parameter w has a non-finite gradient" in result["skip_warnings"][0], (rank, result)
        assert result["skip_w_unchanged"] and result["skip_v_stepped"], (rank, result)


def _fp16_column_over_row_shards(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = nn.Parameter(distribute_tensor(torch.zeros(64, 64, dtype=torch.float16), mesh, [Shard(0)]))
    opt = orthoptim.Dion([("w", p)], rank_fraction=0.25, distributed_mesh=mesh)
    g = torch.zeros(64, 64, dtype=torch.float16)
    g[:, 0] = 9000.0
    p.grad = distribute_tensor(g, mesh, [Shard(0)])
    try:
        opt.step()
        return "stepped"
    except orthoptim.NonFiniteGradientError as e:
        return f"{e} | unchanged: {bool((p.to_local() == 0).all())}"


def test_fp16_overflow_check_of_row_shards_bounds_the_whole_columns():
    """Column 0 of B is 9000 in every row: its norm is 9000·√64 = 72000 > 65504, so Bᵀ P overflows fp16,
    but each of 2 row shards holds only 9000·√32 ≈ 50900 of it. The shard's norm times √(row shards)
    bounds the whole column; without that factor every rank stepped into inf."""
    for rank, result in enumerate(run_distributed(_fp16_column_over_row_shards, 2, timeout=60)):
        assert "parameter w" in result and "overflow float16" in result, (rank, result)
        assert result.endswith("unchanged: True"), (rank, result)


# Blocks of 8 rows or columns that are not torch.chunk's split ([4, 4] and [2, 2, 2, 2]). On 4 ranks,
# ranks 0 and 3 hold what torch.chunk would give them: only a comparison across ranks sees the problem.
UNEVEN_BLOCKS = {2: [3, 5], 4: [2, 1, 3, 2]}


def _uneven_blocks(rank: int, world: int) -> dict:
    """DTensors built from local blocks that are not torch.chunk's split: every rank must raise (a rank
    that passed would wait in the first step's collective for ranks that raised)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for dim in (0, 1):
        size = UNEVEN_BLOCKS[world][rank]
        local = torch.randn((size, 6) if dim == 0 else (6, size))
        shape = (8, 6) if dim == 0 else (6, 8)
        p = nn.Parameter(DTensor.from_local(local, mesh, [Shard(dim)], shape=torch.Size(shape),
                                            stride=(shape[1], 1)))
        out[dim] = value_error(partial(orthoptim.Dion3, [("w", p)], distributed_mesh=mesh))
    return out


def _uneven_dion_blocks(rank: int, world: int) -> str:
    """Dion (factor-sharded, no assembly) on the blocks of UNEVEN_BLOCKS, then a Dion3 parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    size = UNEVEN_BLOCKS[world][rank]
    bad = nn.Parameter(DTensor.from_local(torch.randn(size, 6), mesh, [Shard(0)], shape=torch.Size((8, 6)),
                                          stride=(6, 1)))
    good = nn.Parameter(DTensor.from_local(torch.randn(2, 6), mesh, [Shard(0)], shape=torch.Size((8, 6)),
                                           stride=(6, 1)))
    try:
        orthoptim.Dion3([{"params": [("bad", bad)], "algorithm": "dion"},
                         {"params": [("good", good)], "algorithm": "dion3"}], distributed_mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


def _grid_blocks(rank: int, world: int, case: str, fallback: bool = False) -> str:
    """A 2×2 mesh (dims "outer", "inner") where only one rank's block is not torch.chunk's: every rank
    must raise at construction, also those whose groups for this parameter do not include that rank
    (the step's collectives run over every mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if fallback:  # the library's own torch.chunk rule, for torch versions without DTensor's private one
        from orthoptim.distributed import dtensor
        dtensor._dtensor_local_shape = None
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))

    def make(placements, local_shape):
        return nn.Parameter(DTensor.from_local(torch.randn(local_shape), mesh, placements, shape=torch.Size((8, 6)),
                                               stride=(6, 1)))

    try:
        if case == "dion_rows_only":  # rows over "outer", replicated over "inner"; rank 0 holds 3 rows
            orthoptim.Dion([("a", make([Shard(0), Replicate()], (3, 6) if rank == 0 else (4, 6)))], lr=0.01,
                           outer_shard_mesh=mesh["outer"], inner_shard_mesh=mesh["inner"])
        elif case == "muon_gathered":  # FSDP x TP, assembled by Muon; rank 3 holds 2 of its 3 columns
            orthoptim.Muon([("b", make([Shard(0), Shard(1)], (4, 2) if rank == 3 else (4, 3)))], lr=0.01,
                           distributed_mesh=mesh["outer"])
    except ValueError as e:
        return str(e)
    return "no error"


def test_dion_blocks_that_are_not_torch_chunk_shards_are_refused_on_every_rank():
    for rank, result in enumerate(run_distributed(_uneven_dion_blocks, 4, timeout=90)):
        if UNEVEN_BLOCKS[4][rank] == 2:  # its own block is torch.chunk's
            assert "another rank holds a block of a parameter of param group 0" in result, result
        else:
            assert f"holds a block of shape ({UNEVEN_BLOCKS[4][rank]}, 6) of its (8, 6)" in result, result
            assert "gives (2, 6)" in result, result


@pytest.mark.parametrize("fallback", [False, True], ids=["dtensor-rule", "own-rule"])
@pytest.mark.parametrize(("case", "bad_rank", "block", "expected"), [
    ("dion_rows_only", 0, "(3, 6)", "(4, 6)"), ("muon_gathered", 3, "(4, 2)", "(4, 3)")])
def test_a_wrong_block_on_one_rank_of_a_2d_mesh_is_refused_on_every_rank(case, bad_rank, block, expected, fallback):
    for rank, result in enumerate(run_distributed(partial(_grid_blocks, case=case, fallback=fallback), 4,
                                                  timeout=90)):
        if rank == bad_rank:
            assert f"holds a block of shape {block}" in result and f"gives {expected}" in result, result
        else:
            assert "another rank holds a block" in result and "torch.chunk" in result, result


@pytest.mark.parametrize("world", [2, 4])
def test_blocks_that_are_not_torch_chunk_shards_are_refused_at_construction(world):
    for rank, result in enumerate(run_distributed(_uneven_blocks, world, timeout=90)):
        mine, chunk = UNEVEN_BLOCKS[world][rank], 8 // world
        for dim in (0, 1):
            if mine == chunk:
                assert "another rank holds a block" in result[dim], result
            else:
                shape = (mine, 6) if dim == 0 else (6, mine)
                assert f"holds a block of shape {shape}" in result[dim] and "torch.chunk" in result[dim], result


def _tall_dion2_global(rank: int, world: int) -> list[str]:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    tall = nn.Parameter(distribute_tensor(torch.randn(40, 16), mesh, [Shard(0)]))
    wide = nn.Parameter(distribute_tensor(torch.randn(16, 40), mesh, [Shard(0)]))
    messages = []
    for scope in ("global", "local"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            orthoptim.Dion2([("up.weight", tall), ("down.weight", wide)], selection_scope=scope,
                            distributed_mesh=mesh)
        messages.append(" | ".join(str(w.message) for w in caught))
    return messages


def test_global_selection_of_tall_row_sharded_dion2_matrices_is_said_not_to_be_the_one_process_one():
    """One process selects a tall matrix's columns, row-sharded Dion2 its rows: 'global' cannot equal it."""
    for global_scope, local_scope in run_distributed(_tall_dion2_global, 2, timeout=60):
        assert "up.weight" in global_scope and "down.weight" not in global_scope, global_scope
        assert "selects rows" in global_scope and "columns" in global_scope, global_scope
        assert local_scope == "", local_scope


def _options_by_rank(rank: int, world: int) -> list[tuple[str, bool]]:
    """Each case builds the optimizer with one option that differs on rank 1: the step raises on every
    rank, naming the parameter, before anything changes (it used to abort gloo or hang)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    odd = rank == 1
    cases = {
        "fraction": lambda p: orthoptim.Dion3([("w", p)], fraction=0.5 if odd else 0.25, distributed_mesh=mesh),
        "selection_scope": lambda p: orthoptim.Dion3([("w", p)], selection_scope="local" if odd else "global",
                                                     distributed_mesh=mesh),
        "rank_fraction": lambda p: orthoptim.Dion([("w", p)], rank_fraction=0.5 if odd else 0.25,
                                                  outer_shard_mesh=mesh),
        "algorithm": lambda p: orthoptim.Dion3([{"params": [("w", p)], "algorithm": "muon" if odd else "dion3"}],
                                               distributed_mesh=mesh),
        # a scheduler stepped on a rank's own metric: the ranks stepped with their own lr, silently
        "lr": lambda p: orthoptim.Dion3([("w", p)], lr=0.02 if odd else 0.01, distributed_mesh=mesh),
        # a capturable Dion step gathers its Householder factors every step: the ranks hung
        "capturable": lambda p: orthoptim.Dion([("w", p)], capturable=odd, outer_shard_mesh=mesh),
    }
    out = []
    for name, build in cases.items():
        gen = torch.Generator().manual_seed(0)
        p = nn.Parameter(distribute_tensor(torch.randn(16, 12, generator=gen), mesh, [Shard(0)]))
        opt = build(p)
        before = p.full_tensor().clone()
        p.grad = distribute_tensor(torch.randn(16, 12, generator=gen), mesh, [Shard(0)])
        message = value_error(opt.step)
        out.append((name, message, torch.equal(p.full_tensor(), before)))
    # Same-shape matrices listed in another order on one rank: their rows were exchanged as one
    # matrix's, silently.
    a, b = (nn.Parameter(distribute_tensor(torch.randn(16, 12), mesh, [Shard(0)])) for _ in range(2))
    opt = orthoptim.Dion3([("b", b), ("a", a)] if odd else [("a", a), ("b", b)], distributed_mesh=mesh)
    before = a.full_tensor().clone()
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    out.append(("order", value_error(opt.step), torch.equal(a.full_tensor(), before)))
    # The same options built separately on each rank are not "different", nor is a key of the user's
    # whose repr differs by process (a set of strings: hash order), nor a tensor lr (not read on the host).
    p = nn.Parameter(distribute_tensor(torch.randn(16, 12), mesh, [Shard(0)]))
    opt = orthoptim.Dion3([{"params": [("w", p)], "fraction": 0.25, "tags": {"attn", "mlp", "qkv", "proj"},
                            "lr": torch.tensor(0.01)}], distributed_mesh=mesh)
    p.grad = torch.ones_like(p)
    opt.step()
    return out


def test_options_that_differ_between_ranks_are_refused_on_every_rank():
    for per_rank in run_distributed(_options_by_rank, 2, timeout=90):
        for name, message, unchanged in per_rank:
            named = ("'a'" in message and "'b'" in message) if name == "order" else "['w']" in message
            assert named and "differ between ranks" in message, (name, message)
            assert unchanged, name


def _refused_on_one_rank(rank: int, world: int) -> dict:
    """A step refused on one rank for a reason of its own (an lr edited there, an integer gradient, a
    parameter appended to its group by hand, a deleted option): that rank raised before the verdict's
    all-reduce, the others waited in it for ever (or, with the error caught, paired their step with
    its next one). Now every rank raises, nothing changes, and a next step is one process's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(3)
    init, grad = torch.randn(16, 12, generator=gen), torch.randn(16, 12, generator=gen)
    out = {}
    for case in ("lr", "int_grad", "appended", "key", "after_removal"):
        p = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))
        extra = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))  # (a collective: every rank)
        extra.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        opt = orthoptim.Dion3([("w", p), ("extra", extra)] if case == "after_removal" else [("w", p)], lr=0.05,
                              distributed_mesh=mesh)
        p.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        if rank == 1 and case in ("lr", "after_removal"):
            opt.param_groups[0]["lr"] = float("nan")
        if case == "after_removal":  # taken out by hand on every rank: the refusing rank's table kept it
            opt.param_groups[0]["params"].pop()
            opt.param_groups[0]["param_names"].pop()
        if rank == 1 and case == "int_grad":
            p.grad.data = p.grad.data.to(torch.int64)
        if rank == 1 and case == "appended":  # the refusing rank's groups are not the others' size
            opt.param_groups[0]["params"].append(extra)
        if rank == 1 and case == "key":  # not a ValueError
            del opt.param_groups[0]["fraction"]
        try:
            opt.step()
            message = "no error"
        except (ValueError, KeyError) as error:
            message = str(error)
        out[case] = (message, torch.equal(p.full_tensor(), init))
        if case == "lr":  # caught, fixed, stepped again: every rank steps together
            opt.param_groups[0]["lr"] = 0.05
            opt.step()
            single = nn.Parameter(init.clone())
            single.grad = grad.clone()
            orthoptim.Dion3([single], lr=0.05).step()
            out["next step error"] = float((p.full_tensor() - single).norm() / single.norm())
    return out


def test_a_step_refused_on_one_rank_is_refused_on_every_rank():
    own = {"lr": "lr=nan", "int_grad": "dtype torch.int64", "appended": "put into group['params'] directly",
           "key": "fraction", "after_removal": "lr=nan"}
    for rank, result in enumerate(run_distributed(_refused_on_one_rank, 2, timeout=90)):
        for case, reason in own.items():
            message, unchanged = result[case]
            assert (reason if rank == 1 else "another rank refused this step") in message, (rank, case, message)
            assert unchanged, (rank, case)
        assert result["next step error"] <= 1e-6, result
