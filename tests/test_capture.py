"""capturable=True: a step without host reads, with tensor learning rates, that equals the default step;
CapturedStep replays equal eager steps on CUDA (skipped without a GPU) and run eagerly elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import orthoptim
from orthoptim.orthogonalize.power_iteration import orthonormalize_columns

OPTIMIZERS = {
    "dion3": (orthoptim.Dion3, {"fraction": 0.5}),
    "dion2": (orthoptim.Dion2, {"fraction": 0.5}),
    "muon": (orthoptim.Muon, {"nesterov": True}),
    "normuon": (orthoptim.NorMuon, {}),
    "dion": (orthoptim.Dion, {"rank_fraction": 0.5}),
}
SHAPES = [(16, 32), (16, 32), (40, 12), (12,), (7,)]


def _model(device: str = "cpu") -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in SHAPES]


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [{"params": params[:3]}, {"params": params[3:4], "algorithm": "adamw", "lr": 0.003},
            {"params": params[4:], "algorithm": "lion", "lr": 0.001}]


def _grads(step: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen).to(device) for s in SHAPES]


def _train(name: str, capturable: bool, steps: int = 4, device: str = "cpu", captured: bool = False):
    cls, options = OPTIMIZERS[name]
    params = _model(device)
    opt = cls(_groups(params), lr=0.02, weight_decay=0.1, capturable=capturable, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))  # a new lr every step
    run = orthoptim.CapturedStep(opt, warmup_steps=2) if captured else opt.step
    for p in params:
        p.grad = torch.zeros_like(p)
    for step in range(steps):
        for p, g in zip(params, _grads(step, device)):
            p.grad.copy_(g)  # same gradient tensors every step, as a captured graph needs
        run()
        schedule.step()
    return [p.detach().cpu() for p in params], opt, run


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_capturable_step_reads_nothing_back_from_the_device(name):
    cls, options = OPTIMIZERS[name]
    for capturable in (False, True):
        params = _model()
        opt = cls(_groups(params), capturable=capturable, **options)
        for p, g in zip(params, _grads(0)):
            p.grad = g
        with orthoptim.HostSyncCounter() as counter:
            opt.step()
            opt.step()
        if capturable:
            assert counter.names == [], counter.names
        else:  # the default step checks gradients with one read-back: the counter sees it
            assert "aten::_local_scalar_dense" in counter.names


@pytest.mark.parametrize(("read", "name"), [
    (lambda x: x.sum().item(), "aten::_local_scalar_dense"),
    (lambda x: x.tolist(), "Tensor.tolist"),
    (lambda x: x.cpu(), "Tensor.cpu"),
    (lambda x: x.numpy(), "Tensor.numpy"),
    (lambda x: x[x > 0], "aten::index"),
    (lambda x: x.__setitem__(x > 0, 0.0), "aten::index_put_"),
    (lambda x: torch.repeat_interleave(torch.tensor([1, 2])), "aten::repeat_interleave"),
    (lambda x: torch.bincount(torch.tensor([1, 2])), "aten::bincount"),
    (lambda x: torch.allclose(x, x), "aten::allclose"),
    (lambda x: torch.where(x > 0), "aten::nonzero"),
    (lambda x: torch.masked_select(x, x > 0), "aten::masked_select"),
    (lambda x: torch.equal(x, x), "aten::equal"),
    (lambda x: torch.unique(x), "aten::_unique2"),
    (lambda x: torch.unique_consecutive(x), "aten::unique_consecutive"),
    (lambda x: torch.unique(x, dim=0), "aten::unique_dim"),
])
def test_the_host_sync_counter_sees_each_kind_of_read(read, name):
    x = torch.randn(4, 3)
    with orthoptim.HostSyncCounter() as counter:
        read(x)
    assert name in counter.names, counter.names
    with orthoptim.HostSyncCounter() as counter:  # what stays on the device is not a read
        x[torch.tensor([0, 2])] = 1.0
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([1, 2]), output_size=3)
        x.to(torch.float64)
    assert counter.names == [], counter.names


def test_the_host_sync_counter_patches_nothing_and_nests():
    """It once replaced Tensor methods process-wide: counters exited out of order left them patched."""
    outer, inner = orthoptim.HostSyncCounter(), orthoptim.HostSyncCounter()
    x = torch.randn(3)
    with outer:
        with inner:
            x.tolist()
        x.cpu()
    assert inner.names == ["Tensor.tolist"] and outer.names.count("Tensor.cpu") == 1, (inner.names, outer.names)
    assert "tolist" not in vars(torch.Tensor) or vars(torch.Tensor)["tolist"] is torch._C.TensorBase.tolist
    x.tolist()
    assert inner.names == ["Tensor.tolist"]  # nothing recorded after the block


@pytest.mark.parametrize("blocks", [{"num_heads": 2}, {"split_sizes": [8, 8, 8]}])
def test_capturable_fp16_dion_with_blocks_reads_nothing_back(blocks):
    """The fp16 overflow check took the largest block norm with Python's max: one read per block."""
    p = torch.nn.Parameter(torch.randn(24, 16).half())
    opt = orthoptim.Dion([{"params": [p], **blocks}], capturable=True)
    p.grad = torch.randn(24, 16).half()
    with orthoptim.HostSyncCounter() as counter:
        opt.step()
    assert counter.names == [], counter.names


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_capturable_step_equals_default_step_under_an_lr_schedule(name):
    want, _, _ = _train(name, capturable=False)
    got, opt, _ = _train(name, capturable=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    lrs = [group["lr"] for group in opt.param_groups]
    assert all(isinstance(lr, torch.Tensor) and lr.ndim == 0 for lr in lrs)
    assert math.isclose(float(lrs[0]), 0.02 / 5, rel_tol=1e-6)  # filled in place by the scheduler


def test_adamw_step_count_lives_on_the_parameters_device():
    params = _model()
    opt = orthoptim.Muon(_groups(params), capturable=True)
    assert opt.state[params[3]]["step"].device == params[3].device


def test_nonfinite_gradient_is_flagged_and_check_raises_with_the_name():
    params = _model()
    opt = orthoptim.Dion3([("blocks.0.mlp", params[0]), ("blocks.0.attn", params[1]), ("head", params[2])],
                          capturable=True)
    for p, g in zip(params[:3], _grads(0)):
        p.grad = g
    opt.step()
    opt.check_nonfinite()  # all finite: no error
    assert not bool(opt.nonfinite_found)
    params[0].grad[3, 4] = float("nan")
    opt.step()
    assert bool(opt.nonfinite_found)
    with pytest.raises(orthoptim.NonFiniteGradientError, match=r"blocks\.0\.mlp"):
        opt.check_nonfinite()


def test_the_nonfinite_flag_holds_until_it_is_checked():
    """The docs check every 100 steps: a flag of the last step only forgot a NaN step followed by finite
    ones (its update had already made weights NaN). Also across steps with other parameter sets."""
    params = _model()
    opt = orthoptim.Dion3([("blocks.0.mlp", params[0]), ("blocks.0.attn", params[1])], capturable=True)
    for step in range(5):
        for p, g in zip(params[:2], _grads(step)):
            p.grad = g
        if step == 1:
            params[0].grad[3, 4] = float("inf")
        if step == 3:
            params[0].grad = None  # another set of parameters with gradients
        opt.step()
    assert bool(opt.nonfinite_found)
    with pytest.raises(orthoptim.NonFiniteGradientError, match=r"blocks\.0\.mlp"):
        opt.check_nonfinite()
    assert not bool(opt.nonfinite_found)  # cleared by the check that raised
    opt.check_nonfinite()


def test_skip_mode_and_capture_are_refused_together():
    with pytest.raises(ValueError, match=r"nonfinite='skip'.*capturable"):
        orthoptim.Muon(_model()[:1], nonfinite="skip", capturable=True)
    with pytest.raises(ValueError, match="capturable=True"):
        orthoptim.CapturedStep(orthoptim.Muon(_model()[:1]))


def test_captured_step_runs_eagerly_off_cuda():
    want, _, _ = _train("dion3", capturable=True)
    got, _, run = _train("dion3", capturable=True, captured=True)
    assert not run.captured
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_sync_free_cholesky_qr_falls_back_per_matrix_on_the_device():
    gen = torch.Generator().manual_seed(0)
    good = torch.randn(40, 6, generator=gen)
    bad = torch.randn(40, 6, generator=gen)
    bad[:, 5] = bad[:, 4] * (1 + 1e-9)  # rank deficient: Cholesky-QR is not trusted here
    p = torch.stack([good, bad])
    with orthoptim.HostSyncCounter() as counter:
        q = orthonormalize_columns(p, sync_free=True)
    assert counter.names == []
    torch.testing.assert_close(q, orthonormalize_columns(p), rtol=0, atol=0)
    eye = torch.eye(6).expand(2, 6, 6)
    torch.testing.assert_close(q.mT @ q, eye, atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_captured_cuda_graph_replays_equal_eager_steps(name):
    want, _, _ = _train(name, capturable=True, steps=6, device="cuda")
    got, _, run = _train(name, capturable=True, steps=6, device="cuda", captured=True)
    assert run.captured
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_capturable_state_dict_round_trip_keeps_device_steps_and_tensor_lrs():
    _, opt, _ = _train("muon", capturable=True, steps=2)
    params = _model()
    cls, options = OPTIMIZERS["muon"]
    fresh = cls(_groups(params), capturable=True, **options)  # the same options: loading changes none
    fresh.load_state_dict(opt.state_dict())
    assert isinstance(fresh.param_groups[0]["lr"], torch.Tensor)
    assert fresh.state[params[3]]["step"].device == params[3].device
    assert float(fresh.state[params[3]]["step"]) == 2.0


@pytest.mark.parametrize("name", ["dion3", "dion", "muon"])
def test_a_capturable_load_keeps_the_tensors_a_captured_graph_reads(name):
    """docs/capture.md restores a checkpoint after a non-finite step: loading replaced every lr and
    state tensor, so a captured graph would have kept replaying on the old ones."""
    _, source, _ = _train(name, capturable=True, steps=3)
    _, target, _ = _train(name, capturable=True, steps=1)
    tensors = lambda opt: [g["lr"] for g in opt.param_groups] + [  # noqa: E731
        t for p in (q for g in opt.param_groups for q in g["params"]) for t in opt.state[p].values()]
    before = [id(t) for t in tensors(target)]
    target.load_state_dict(source.state_dict())
    assert [id(t) for t in tensors(target)] == before
    for a, b in zip(tensors(target), tensors(source), strict=True):
        assert torch.equal(a, b)


def test_tensor_learning_rate_is_accepted_and_checked():
    params = _model()
    opt = orthoptim.Dion3(params[:3], lr=torch.tensor(0.02), capturable=True)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    with pytest.raises(ValueError, match="lr="):
        orthoptim.Dion3(params[:3], lr=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match="lr="):
        orthoptim.Dion3(params[:3], lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="lr="):
        orthoptim.Dion3(params[:3], lr=torch.tensor([0.1]))  # one element, but not a 0-dim tensor


@pytest.mark.parametrize("capturable", [True, False])
def test_groups_inheriting_a_tensor_lr_get_their_own_copy(capturable):
    params = _model()
    opt = orthoptim.Muon([{"params": params[:2]}, {"params": params[2:3]}], lr=torch.tensor(0.02),
                         capturable=capturable)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, [lambda t: 1.0, lambda t: 0.1])
    opt.step()  # no gradients: nothing moves, but the scheduler sees the usual order
    schedule.step()
    assert math.isclose(float(opt.param_groups[0]["lr"]), 0.02, rel_tol=1e-6)
    assert math.isclose(float(opt.param_groups[1]["lr"]), 0.002, rel_tol=1e-6)


def test_capture_refuses_global_row_selection():
    with pytest.raises(ValueError, match="selection_scope='global'"):
        orthoptim.Dion3(_model()[:1], selection_scope="global", capturable=True)


def test_nonfinite_flags_are_the_same_buffers_every_step():
    params = _model()[:3]
    opt = orthoptim.Muon(params, capturable=True)
    for p, g in zip(params, _grads(0)):
        p.grad = g
    opt.step()
    (flag_set,) = opt._flag_sets.values()  # one set of parameters with gradients
    flags, found = flag_set[1], opt.nonfinite_found
    params[1].grad[0, 0] = float("inf")
    opt.step()
    (flag_set,) = opt._flag_sets.values()
    assert flag_set[1] is flags and opt.nonfinite_found is found  # what a graph would write
    assert bool(found)
    with pytest.raises(orthoptim.NonFiniteGradientError):
        opt.check_nonfinite()


def test_bad_capture_options_are_named():
    with pytest.raises(ValueError, match="capturable="):
        orthoptim.Muon(_model()[:1], capturable="yes")
    with pytest.raises(ValueError, match="warmup_steps="):
        orthoptim.CapturedStep(orthoptim.Muon(_model()[:1], capturable=True), warmup_steps=0)


@pytest.mark.parametrize("shapes", [[(3,), (4,)], [(3,), (3,)], [(1,), (1,)]], ids=["sizes", "same_size", "scalar"])
def test_a_step_with_other_parameters_having_gradients_flags_those(shapes):
    """The flags are reused only for the same parameters (by identity, not by value): with a gradient
    on another parameter the step still runs and check_nonfinite names that parameter."""
    first, second = (nn.Parameter(torch.zeros(s)) for s in shapes)
    opt = orthoptim.Dion3([{"params": [first, second], "param_names": ["first", "second"], "algorithm": "lion"}],
                          lr=0.0, capturable=True)
    first.grad = torch.ones_like(first)
    opt.step()
    first.grad, second.grad = None, torch.full_like(second, float("nan"))
    opt.step()
    with pytest.raises(orthoptim.NonFiniteGradientError, match=r"\['second'\]"):
        opt.check_nonfinite()
