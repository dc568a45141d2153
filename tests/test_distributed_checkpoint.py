"""Optimizer state saved with torch.distributed.checkpoint loads into another world size (2 → 4 ranks,
4 ranks → 1 process), and the next step equals what the original layout computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import orthoptim
from tests.distributed_harness import run_distributed

OPTIMIZERS = {
    "normuon": lambda groups, **kw: orthoptim.NorMuon(groups, lr=0.02, **kw),
    "dion3": lambda groups, **kw: orthoptim.Dion3(groups, lr=0.02, fraction=1.0, **kw),  # layout-independent
    "muon": lambda groups, **kw: orthoptim.Muon(groups, lr=0.02, nesterov=True, **kw),
    # Dion's state: momentum DTensors and the right factor Q, a plain tensor equal on every rank.
    "dion": lambda groups, **kw: orthoptim.Dion(groups, lr=0.02, rank_fraction=0.5, **kw),
}


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 18), nn.Tanh(), nn.Linear(18, 18), nn.Tanh(), nn.Linear(18, 4))


def _build(name: str, world: int | None):
    model = _model()
    if world is None:
        return model, OPTIMIZERS[name](orthoptim.param_groups(model))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from orthoptim.train.loop import fully_shard_options

    mesh = init_device_mesh("cpu", (world,))
    options = fully_shard_options(mesh)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model, OPTIMIZERS[name](orthoptim.param_groups(model), distributed_mesh=mesh)


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        data, target = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
        nn.functional.mse_loss(model(data), target).backward()
        opt.step()
        opt.zero_grad()


def _full(model) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _save_then_step(rank: int, world: int, name: str, path: str) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _build(name, world)
    _train(model, opt, 3, seed=0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    _train(model, opt, 1, seed=7)
    return _full(model)


def _load_then_step(rank: int | None, world: int | None, name: str, path: str,
                    optimizer_state: bool = True) -> list[torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build(name, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    # (get_state_dict hands out the live tensors, so dcp.load fills in place what it is given)
    state = {"model": model_sd, "optim": optim_sd} if optimizer_state else {"model": model_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state.get("optim", optim_sd))
    _train(model, opt, 1, seed=7)
    return _full(model)


def _errors(got, want) -> list[float]:
    return [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]


def _each(fn, rank: int, world: int, path: str) -> dict:
    # One set of processes for every optimizer: spawning ranks costs more than the steps.
    return {name: fn(rank, world, name, f"{path}/{name}") for name in sorted(OPTIMIZERS)}


def _save_each(rank: int, world: int, path: str) -> dict:
    return _each(_save_then_step, rank, world, path)


def _load_each(rank: int, world: int, path: str) -> dict:
    return _each(_load_then_step, rank, world, path)


def test_checkpoint_reshards_from_2_to_4_ranks(tmp_path):
    original = run_distributed(_save_each, 2, str(tmp_path), timeout=240)[0]
    resumed = run_distributed(_load_each, 4, str(tmp_path), timeout=240)
    for name in OPTIMIZERS:
        for rank_result in resumed:
            assert max(_errors(rank_result[name], original[name])) <= 1e-5, name


# Loading without a process group is the point here; torch.distributed.checkpoint says so in a warning.
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_from_4_ranks_loads_into_one_process(tmp_path):
    original = run_distributed(_save_then_step, 4, "normuon", str(tmp_path), timeout=120)[0]
    resumed = _load_then_step(None, None, "normuon", str(tmp_path))
    assert max(_errors(resumed, original)) <= 1e-5
    # The optimizer state matters: the same weights with a fresh optimizer take a different step.
    without_state = _load_then_step(None, None, "normuon", str(tmp_path), optimizer_state=False)
    assert max(_errors(without_state, original)) > 1e-3
