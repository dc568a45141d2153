"""Replicated parameters (DDP): every optimizer on 2 and 4 real gloo ranks equals the single-process run,
with one all-gather per megabatch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import orthoptim
from orthoptim.distributed import CommStats
from tests.distributed_harness import run_distributed, value_error

# fp32 Newton-Schulz on a share of the batch vs the whole batch: same math, different BLAS blocking.
REL_TOL = 1e-5
STEPS = 3

SHAPES = [(24, 40), (24, 40), (24, 40), (40, 24), (3, 16, 32), (32, 16)]  # a 3-matrix megabatch, tall, 3-D


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_(True) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


CONFIGS = {
    "dion3": (orthoptim.Dion3, {"fraction": 0.5}),
    "dion2": (orthoptim.Dion2, {"fraction": 0.5}),
    "muon": (orthoptim.Muon, {"nesterov": True}),
    "normuon": (orthoptim.NorMuon, {}),
    "dion_group": (orthoptim.Dion3, {"algorithm": "dion", "rank_fraction": 0.5}),
    "dion": (orthoptim.Dion, {"rank_fraction": 0.5}),
    # Weights stored [in, out], read transposed: the same three megabatches, of the transposed shapes.
    "muon_transposed": (orthoptim.Muon, {"transpose": True}),
    "dion3_transposed": (orthoptim.Dion3, {"fraction": 0.5, "transpose": True}),
    "dion_transposed": (orthoptim.Dion, {"rank_fraction": 0.5, "transpose": True}),
}


def _run(name: str, mesh) -> tuple[list[torch.Tensor], list[dict]]:
    cls, options = CONFIGS[name]
    params = _params()
    group_options = {k: v for k, v in options.items() if k in ("algorithm", "rank_fraction", "transpose")}
    ctor_options = {k: v for k, v in options.items() if k not in group_options}
    groups = [{"params": params[:-1], **group_options}, {"params": params[-1:], "algorithm": "adamw"}]
    opt = cls(groups, lr=0.05, weight_decay=0.1, distributed_mesh=mesh, **ctor_options)
    stats = CommStats()
    opt.comm_stats = stats
    per_step = []
    for step in range(STEPS):
        for p, g in zip(params, _grads(step)):
            p.grad = g
        stats.reset()
        opt.step()
        per_step.append(stats.as_dict())
    return [p.detach().clone() for p in params], per_step


def _compare_all(rank: int, world: int) -> dict:
    out = {}
    for name in CONFIGS:
        reference, _ = _run(name, None)
        got, comm = _run(name, dist.group.WORLD)
        errors = [float((g - r).norm() / r.norm()) for g, r in zip(got, reference)]
        out[name] = {"errors": errors, "comm": comm}
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_replicated_parameters_match_single_process(world_size):
    results = run_distributed(_compare_all, world_size, timeout=180)
    # Megabatches of the matrix group: (24, 40) x3, (40, 24), (16, 32) x3 from the 3-D parameter.
    megabatches = 3
    for rank, result in enumerate(results):
        for name, rec in result.items():
            assert max(rec["errors"]) <= REL_TOL, (rank, name, rec["errors"])
            for step_comm in rec["comm"]:
                assert step_comm["all_gather"]["calls"] == megabatches, (name, step_comm)
    # Every rank ends with the same parameters: compare the errors' source, the params, via rank 0's.
    assert all(r.keys() == results[0].keys() for r in results)


SHARE_BATCHES = {(16, 32): 4, (8, 16): 3}  # a megabatch the world size divides, and one it does not


def _share_bytes(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape, count in SHARE_BATCHES.items()
              for _ in range(count)]
    opt = orthoptim.Muon(params, lr=0.01, distributed_mesh=dist.group.WORLD)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.comm_stats = CommStats()
    opt.step()
    return opt.comm_stats.as_dict()["all_gather"]


def test_each_rank_orthogonalizes_and_gathers_ceil_batch_over_world_matrices():
    """Rank r's share of a megabatch of B is c = ceil(B / world) matrices, and it all-gathers just those:
    a share of B // world + 1 gives the same update but computes and sends a padding matrix more
    wherever the world size divides B."""
    world = 2
    want = {"calls": len(SHARE_BATCHES),
            "bytes": sum(math.ceil(count / world) * m * n * 4 for (m, n), count in SHARE_BATCHES.items())}
    for rank, result in enumerate(run_distributed(_share_bytes, world, timeout=60)):
        assert result == want, (rank, result)


def _ddp_training(rank: int, world: int) -> dict:
    """Real DDP: each rank sees its slice of the batch; equals one process on the whole batch."""
    torch.manual_seed(0)
    data = torch.randn(8 * world, 16)
    target = torch.randn(8 * world, 4)

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))

    single = model()
    opt_single = orthoptim.Dion3(orthoptim.param_groups(single), lr=0.02, fraction=0.5)
    ddp = nn.parallel.DistributedDataParallel(model())
    opt_ddp = orthoptim.Dion3(orthoptim.param_groups(ddp.module), lr=0.02, fraction=0.5,
                              distributed_mesh=dist.group.WORLD)
    lo, hi = rank * 8, (rank + 1) * 8
    for _ in range(4):
        nn.functional.mse_loss(single(data), target).backward()
        opt_single.step()
        opt_single.zero_grad()
        nn.functional.mse_loss(ddp(data[lo:hi]), target[lo:hi]).backward()
        opt_ddp.step()
        opt_ddp.zero_grad()
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(ddp.module.parameters(), single.parameters())]
    return {"errors": errors, "params": [p.detach().clone() for p in ddp.module.parameters()]}


def test_ddp_model_matches_single_process_on_the_whole_batch():
    results = run_distributed(_ddp_training, 2, timeout=120)
    for rank, rec in enumerate(results):
        assert max(rec["errors"]) <= 1e-4, (rank, rec["errors"])  # gradient averaging reorders sums
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)  # ranks stay bit-identical


def _grad_on_one_rank(rank: int, world: int) -> dict:
    """A parameter with a gradient on rank 0 only (e.g. a branch taken on one rank), and a step in
    which rank 1 has no gradient at all: both hung in mismatched collectives."""
    out = {}
    for case in ("one_parameter", "no_gradient_on_rank_1", "capturable"):
        params = [nn.Parameter(t) for t in _params()]
        opt = orthoptim.Dion3([("w0", params[0]), ("w1", params[1]), ("w2", params[2])],
                              distributed_mesh=dist.group.WORLD, capturable=case == "capturable")
        before = [p.detach().clone() for p in params]
        for i, (p, g) in enumerate(zip(params, _grads(0))):
            give = rank == 0 or (case != "no_gradient_on_rank_1" and i != 1)
            p.grad = g if give else None
        out[case] = value_error(opt.step)
        out[case + "_unchanged"] = all(torch.equal(a, b) for a, b in zip(params, before))
    return out


def test_a_gradient_on_some_ranks_only_is_an_error_on_every_rank():
    for result in run_distributed(_grad_on_one_rank, 2, timeout=120):
        assert "['w1']" in result["one_parameter"] and "some ranks" in result["one_parameter"], result
        assert "some ranks and none on others" in result["no_gradient_on_rank_1"], result
        assert "['w1']" in result["capturable"], result  # eager capturable steps check it too
        assert result["one_parameter_unchanged"] and result["no_gradient_on_rank_1_unchanged"], result
