"""An optimizer inside the tools of a real training loop: ``torch.compile`` (of the step alone and of a
whole training step), a step inside a ``torch.autocast`` block, and copies (``copy.deepcopy``,
``pickle``) continue exactly as the eager original."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import orthoptim
from tests.test_state_dict import CLASSES, EXTRA, assert_same_state, make_model, make_opt, run, same_params, set_grads


def _two_shapes(name: str) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """Two matrices of different shapes (two megabatches) and a vector (the scalar group)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(4, 16)),
              torch.nn.Parameter(torch.randn(8))]
    groups = [{"params": params[:2]}, {"params": params[2:], "algorithm": "adamw"}]
    return params, CLASSES[name](groups, lr=0.02, weight_decay=0.1, **EXTRA.get(name, {}))


def _step_with(params: list[torch.nn.Parameter], step, t: int) -> None:
    gen = torch.Generator().manual_seed(t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    step()


@pytest.mark.parametrize("name", ["dion3", "muon", "dion"])
def test_compiled_step_equals_eager_step(name):
    """Traced by dynamo, the step once applied one megabatch's work to another matrix (its momentum
    doubled, the other's left 0) without an error; the step now runs eagerly under torch.compile."""
    torch._dynamo.reset()
    eager_params, eager = _two_shapes(name)
    compiled_params, compiled = _two_shapes(name)
    step = torch.compile(compiled.step, backend="eager")
    for t in range(3):
        _step_with(eager_params, eager.step, t)
        _step_with(compiled_params, step, t)
    for a, b in zip(eager_params, compiled_params, strict=True):
        assert torch.equal(a, b)
        for key, value in eager.state[a].items():
            assert torch.equal(value, compiled.state[b][key]), key


def test_compiled_training_step_equals_eager():
    """Forward, backward and step compiled together: the step is a graph break, the rest compiles."""
    torch._dynamo.reset()
    x = torch.randn(6, 8)

    def train(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.02)

        def one_step() -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(one_step, backend="eager") if compiled else one_step
        return [step() for _ in range(3)] + [p.detach() for p in model.parameters()]

    for a, b in zip(train(False), train(True), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_step_inside_autocast_is_the_step_outside(name):
    """opt.step() inside the autocast block of the forward pass: autocast rounded the products of the
    (here fp32) iterations to bf16, and Dion's in-place error feedback then met a bf16 P and raised
    half-way through the step. The closure still runs under the caller's autocast."""
    outside_params, outside = _two_shapes(name)
    inside_params, inside = _two_shapes(name)
    seen = []

    def closure() -> torch.Tensor:
        seen.append(torch.is_autocast_enabled("cpu"))
        return torch.zeros(())

    for t in range(3):
        _step_with(outside_params, outside.step, t)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _step_with(inside_params, lambda: inside.step(closure), t)
    assert seen == [True] * 3
    for a, b in zip(outside_params, inside_params, strict=True):
        assert torch.equal(a, b)
        for key, value in outside.state[a].items():
            assert torch.equal(value, inside.state[b][key]), key


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_a_copy_continues_as_the_original(name, how):
    """torch.optim's __getstate__ keeps defaults, state and param_groups only: a copy used to lose the
    names, Dion's Q positions and the step's flags, and failed at its first step."""
    model = make_model()
    opt = make_opt(name, model)
    run(model, opt, range(2))
    pair = (model, opt)
    model2, opt2 = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    assert opt2.param_name(next(model2.parameters())) == opt.param_name(next(model.parameters()))
    for t in range(2, 4):
        set_grads(model, t)
        set_grads(model2, t)
        opt.step()
        opt2.step()
    assert same_params(model, model2)
    assert_same_state(opt, model, opt2, model2)


def test_a_copy_keeps_its_own_hooks_out():
    """As torch.optim: step hooks are not copied (they may hold anything); the copy steps without them."""
    model = make_model()
    opt = make_opt("muon", model)
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append(1))
    opt2 = copy.deepcopy(opt)
    set_grads(model, 0)
    opt2.step()
    assert calls == []
    opt.step()
    assert calls == [1]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_made_under_an_lr_scheduler_steps_its_own_parameters(how):
    """A scheduler wraps the optimizer's step on the instance (bound to that optimizer): copied along,
    the copy's step() updated the original's parameters, and pickling failed."""
    model = make_model()
    opt = make_opt("muon", model)
    torch.optim.lr_scheduler.StepLR(opt, 2)
    run(model, opt, range(1))
    model2, opt2 = copy.deepcopy((model, opt)) if how == "deepcopy" else pickle.loads(pickle.dumps((model, opt)))
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(model2, 1)
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert not all(torch.equal(a, b) for a, b in zip(model2.parameters(), before))
