"""Dion2/Dion3 state stacked per megabatch (``orthoptim.optim.stacked_state``): the batched row selection
gives the per-matrix ops' numbers bit for bit, and the stacks survive what an optimizer goes through."""

from __future__ import annotations

import copy

import pytest
import torch

import orthoptim
from orthoptim.optim import base
from orthoptim.optim.stacked_state import stacked_view, stands_alone
from orthoptim.rules import selection


def test_stacked_view_of_views_of_one_tensor():
    buf = torch.randn(4, 3, 5)
    views = list(buf.unbind(0))
    assert stacked_view(views).data_ptr() == buf.data_ptr() and torch.equal(stacked_view(views), buf)
    assert torch.equal(stacked_view(views[1:3]), buf[1:3])
    every_other = views[::2]
    assert torch.equal(stacked_view(every_other), buf[::2])
    transposed = [v.mT for v in views]  # strides (1, 5): still equally spaced
    assert torch.equal(stacked_view(transposed), buf.mT)


@pytest.mark.parametrize("case", ["separate", "reversed", "repeated", "overlapping", "other strides", "dtype"])
def test_stacked_view_refuses_what_is_not_one_stack(case):
    buf = torch.randn(4, 3, 5)
    views = list(buf.unbind(0))
    tensors = {
        "separate": [torch.randn(3, 5) for _ in range(3)],
        "reversed": views[::-1],
        "repeated": [views[0], views[0]],
        "overlapping": [buf.view(-1)[i : i + 15].view(3, 5) for i in (0, 5, 10)],
        "other strides": [views[0], views[1].mT.contiguous().mT],
        "dtype": [views[0], views[1].double()],
    }[case]
    assert stacked_view(tensors) is None


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    # same-shape small matrices (one stack), a tall one (Dion2 selects its columns), a large one
    # (on CPUs above selection.L1_CHUNK_ELEMENTS: never stacked), a bias (AdamW)
    shapes = [(16, 24), (16, 24), (16, 24), (40, 12), (300, 256)]
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64).to(dtype)) for s in shapes]
    params.append(torch.nn.Parameter(torch.randn(16, dtype=torch.float64).to(dtype)))
    return params


def _optimizer(name, params):
    cls = {"dion3": orthoptim.Dion3, "dion2": orthoptim.Dion2}[name]
    return cls([{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}], lr=0.02,
               weight_decay=0.1, fraction=0.3)


def _grads(params, step, skip=()):
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype)
        p.grad = None if i in skip else g


def _run(name, dtype, stacked, monkeypatch, steps=5, skip_at=None):
    params = _model(dtype)
    opt = _optimizer(name, params)
    with monkeypatch.context() as mp:
        if not stacked:
            mp.setattr(base.OrthonormalOptimizer, "_stacked_selection_state", lambda *_: None)
        for t in range(steps):
            _grads(params, t, skip=(1,) if t == skip_at else ())
            opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["dion3", "dion2"])
def test_batched_selection_gives_the_per_matrix_numbers(monkeypatch, name, dtype):
    """Every step, including one where a matrix of the stack has no gradient (its batch is then not
    one run of the stack, and the per-matrix ops run)."""
    calls = []
    original = selection.accumulate_and_l1_norms_stacked_
    monkeypatch.setattr(selection, "accumulate_and_l1_norms_stacked_", lambda *a: calls.append(1) or original(*a))
    a, opt_a = _run(name, dtype, True, monkeypatch, skip_at=2)
    assert calls, "the batched path did not run"
    b, opt_b = _run(name, dtype, False, monkeypatch, skip_at=2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
        for key, value in opt_a.state[x].items():
            assert torch.equal(value, opt_b.state[y][key]), key


def test_the_state_of_same_shape_small_matrices_is_one_stack():
    params = _model()
    opt = _optimizer("dion3", params)
    stack = [opt.state[p]["momentum"] for p in params[:3]]
    assert stacked_view(stack) is not None and not any(stands_alone(m) for m in stack)
    assert stacked_view([opt.state[p]["variance"] for p in params[:3]]) is not None
    # one of its shape, and one above the CPU size limit, stand alone; so does Muon's state
    assert all(stands_alone(opt.state[p]["momentum"]) for p in params[3:5])
    assert params[4].numel() > selection.L1_CHUNK_ELEMENTS
    muon = orthoptim.Muon(params[:3], lr=0.02)
    assert all(stands_alone(muon.state[p]["momentum"]) for p in params[:3])


@pytest.mark.parametrize("how", ["state_dict", "deepcopy"])
def test_loading_or_copying_keeps_the_stack_and_continues_bit_identically(monkeypatch, how):
    params = _model()
    opt = _optimizer("dion3", params)
    for t in range(3):
        _grads(params, t)
        opt.step()
    if how == "state_dict":
        other_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        other = _optimizer("dion3", other_params)
        other.load_state_dict(copy.deepcopy(opt.state_dict()))
    else:
        other = copy.deepcopy(opt)
        other_params = [p for g in other.param_groups for p in g["params"]]
    assert stacked_view([other.state[p]["momentum"] for p in other_params[:3]]) is not None
    for t in range(3, 6):
        for ps, o in ((params, opt), (other_params, other)):
            _grads(ps, t)
            o.step()
    for x, y in zip(params, other_params, strict=True):
        assert torch.equal(x, y)
