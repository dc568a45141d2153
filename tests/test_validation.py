"""Bad input gets a clear error that names the parameter or option and the fix, and changes nothing.

Construction errors: there is no optimizer yet, so the model's parameters must be untouched.
Errors on a live optimizer (``add_param_group``, ``step`` with a non-finite gradient): every parameter
and the whole ``state_dict()`` must be exactly as before.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

import orthoptim

CLASSES = {
    "dion3": orthoptim.Dion3,
    "dion2": orthoptim.Dion2,
    "dion": orthoptim.Dion,
    "muon": orthoptim.Muon,
    "normuon": orthoptim.NorMuon,
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.lin = nn.Linear(8, 6)
        self.out = nn.Linear(6, 8)
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.LayerNorm(8)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


# ----------------------------------------------------------------------------- snapshots
def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return copy.deepcopy(obj)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal entries, NaN where the other has NaN (a refused NaN lr stays in the group as it was)."""
    if a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _assert_equal(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and _same(a, b), f"{where} changed"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), f"keys of {where} changed"
        for k in a:
            _assert_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where} changed"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where} changed: {a!r} → {b!r}"


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return params, grads, None if opt is None else _clone(opt.state_dict())


def assert_unchanged(before, model: nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    _assert_equal(before[0], {n: p.detach() for n, p in model.named_parameters()}, "parameters")
    if opt is not None:
        _assert_equal(before[2], opt.state_dict(), "optimizer.state_dict()")


def named_group(model: nn.Module, *names: str, **options) -> dict:
    params = dict(model.named_parameters())
    return {"params": [params[n] for n in names], "param_names": list(names), **options}


@contextlib.contextmanager
def raises_naming(exc, *fragments):
    """pytest.raises whose message must also contain every fragment."""
    with pytest.raises(exc) as info:
        yield info
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from the error: {message}"


# ----------------------------------------------------------------------------- construction errors
# (id, build(model) that must raise, exception, fragments the message must contain: the parameter or
# option, and the fix)
CONSTRUCTION_CASES = [
    ("listed_twice", lambda m: orthoptim.Muon([named_group(m, "lin.weight", "out.weight", "lin.weight")]),
     ValueError, ["lin.weight twice", "list each parameter once"]),
    ("maximize", lambda m: orthoptim.Dion3([named_group(m, "lin.weight", maximize=True)]),
     ValueError, ["maximize=True", "param group 0", "negated"]),
    ("differentiable", lambda m: orthoptim.Muon([named_group(m, "lin.weight", differentiable=True)]),
     ValueError, ["differentiable=True", "no_grad"]),
    ("1d_matrix_rule", lambda m: orthoptim.Muon([named_group(m, "lin.bias")]),
     ValueError, ["lin.bias", "at least 2 dims", "algorithm='adamw'"]),
    ("1d_norm_dion3", lambda m: orthoptim.Dion3([named_group(m, "lin.weight"), named_group(m, "norm.weight")]),
     ValueError, ["norm.weight", "algorithm='adamw'"]),
    ("4d_without_flatten", lambda m: orthoptim.Dion3([named_group(m, "conv.weight")]),
     ValueError, ["conv.weight", "flatten=True"]),
    ("fraction_zero", lambda m: orthoptim.Dion3([named_group(m, "lin.weight")], fraction=0.0),
     ValueError, ["fraction=0.0", "(0.0, 1.0]"]),
    ("fraction_negative", lambda m: orthoptim.Dion2([named_group(m, "lin.weight")], fraction=-0.25),
     ValueError, ["fraction=-0.25", "(0.0, 1.0]"]),
    ("fraction_above_one", lambda m: orthoptim.Dion2([named_group(m, "lin.weight")], fraction=1.5),
     ValueError, ["fraction=1.5", "(0.0, 1.0]"]),
    ("fraction_in_group", lambda m: orthoptim.Dion3([named_group(m, "lin.weight", fraction=2)]),
     ValueError, ["fraction=2", "param group 0", "(0.0, 1.0]"]),
    ("rank_fraction_zero", lambda m: orthoptim.Dion([named_group(m, "lin.weight")], rank_fraction=0.0),
     ValueError, ["rank_fraction=0.0", "(0.0, 1.0]"]),
    ("rank_fraction_above_one", lambda m: orthoptim.Dion([named_group(m, "lin.weight")], rank_fraction=1.01),
     ValueError, ["rank_fraction=1.01", "(0.0, 1.0]"]),
    ("negative_lr", lambda m: orthoptim.Muon([named_group(m, "lin.weight")], lr=-0.01),
     ValueError, ["lr=-0.01", "non-negative"]),
    ("negative_lr_in_group", lambda m: orthoptim.Dion3([named_group(m, "lin.weight"),
                                                        named_group(m, "lin.bias", algorithm="adamw", lr=-1.0)]),
     ValueError, ["lr=-1.0", "param group 1", "non-negative"]),
    ("negative_weight_decay", lambda m: orthoptim.NorMuon([named_group(m, "lin.weight")], weight_decay=-0.1),
     ValueError, ["weight_decay=-0.1", "use 0 to disable"]),
    ("negative_mu", lambda m: orthoptim.Muon([named_group(m, "lin.weight")], mu=-0.5),
     ValueError, ["mu=-0.5", "[0.0, 1.0)"]),
    ("mu_one", lambda m: orthoptim.Dion([named_group(m, "lin.weight")], mu=1.0),
     ValueError, ["mu=1.0", "[0.0, 1.0)"]),
    ("mu_above_one", lambda m: orthoptim.Dion2([named_group(m, "lin.weight", mu=1.5)]),
     ValueError, ["mu=1.5", "[0.0, 1.0)"]),
    # beta2 = 1 keeps the variance at zero forever: NorMuon (and Dion3's normalization) silently off.
    ("muon_beta2_one", lambda m: orthoptim.NorMuon([named_group(m, "lin.weight")], muon_beta2=1.0),
     ValueError, ["muon_beta2=1.0", "[0.0, 1.0)"]),
    ("unknown_algorithm", lambda m: orthoptim.Dion3([named_group(m, "lin.weight", algorithm="sgd")]),
     ValueError, ["algorithm='sgd'", "'dion3'", "'adamw'"]),
    ("unknown_adjust_lr", lambda m: orthoptim.Muon([named_group(m, "lin.weight")], adjust_lr="spectral"),
     ValueError, ["adjust_lr='spectral'", "'spectral_norm'", "'rms_norm'"]),
    ("num_heads_not_dividing", lambda m: orthoptim.Dion3([named_group(m, "lin.weight", num_heads=4)]),
     ValueError, ["lin.weight", "num_heads=4", "divide", "6 rows"]),
    ("num_heads_not_dividing_split", lambda m: orthoptim.Muon(
        [named_group(m, "lin.weight", split_sizes=[4, 2], num_heads=4)]),
     ValueError, ["lin.weight", "num_heads=4", "divide"]),
    ("split_sizes_short", lambda m: orthoptim.Muon([named_group(m, "lin.weight", split_sizes=[2, 2])]),
     ValueError, ["lin.weight", "split_sizes=[2, 2]", "sum to", "6 rows"]),
    ("split_sizes_long", lambda m: orthoptim.Dion([named_group(m, "lin.weight", split_sizes=[4, 4])]),
     ValueError, ["lin.weight", "split_sizes=[4, 4]", "sum to"]),
    ("bad_orthogonalizer", lambda m: orthoptim.Muon([named_group(m, "lin.weight")], orthogonalizer="jacobi"),
     ValueError, ["orthogonalizer", "'jacobi'", "'polar_express'", "callable"]),
    ("bad_nonfinite", lambda m: orthoptim.Dion3([named_group(m, "lin.weight")], nonfinite="ignore"),
     ValueError, ["nonfinite='ignore'", "'raise'", "'skip'"]),
    ("bad_selection_scope", lambda m: orthoptim.Dion2([named_group(m, "lin.weight")], selection_scope="world"),
     ValueError, ["selection_scope='world'", "'local'", "'global'"]),
    # A scalar group reads nonfinite too: a typo there must not turn 'raise' into 'skip'.
    ("bad_nonfinite_adamw_group", lambda m: orthoptim.Dion3([named_group(m, "norm.weight", algorithm="adamw",
                                                                         nonfinite="rasie")]),
     ValueError, ["nonfinite='rasie'", "param group 0", "'raise'"]),
    ("split_sizes_an_int", lambda m: orthoptim.Muon([named_group(m, "lin.weight", split_sizes=6)]),
     ValueError, ["split_sizes=6", "list or tuple of ints"]),
    ("split_sizes_a_generator", lambda m: orthoptim.Muon([named_group(m, "lin.weight",
                                                                      split_sizes=(s for s in (3, 3)))]),
     ValueError, ["split_sizes=<generator", "list or tuple of ints"]),
    ("param_names_too_short", lambda m: orthoptim.Muon([{"params": [m.lin.weight, m.out.weight],
                                                          "param_names": ["lin.weight"]}]),
     ValueError, ["2 params but 1 param_names", "one name per parameter"]),
    ("integer_parameter", lambda m: orthoptim.Dion3([named_group(m, "lin.weight"),
                                                     {"params": [torch.zeros(4, dtype=torch.int32)],
                                                      "param_names": ["steps"], "algorithm": "adamw"}]),
     ValueError, ["steps", "torch.int32", "real floating-point"]),
    ("complex_parameter", lambda m: orthoptim.Muon([{"params": [torch.zeros(4, 4, dtype=torch.complex64)],
                                                     "param_names": ["phase"]}]),
     ValueError, ["phase", "torch.complex64", "view_as_real"]),
]


@pytest.mark.parametrize(("build", "exc", "fragments"), [c[1:] for c in CONSTRUCTION_CASES],
                         ids=[c[0] for c in CONSTRUCTION_CASES])
def test_construction_error_names_option_and_fix(build, exc, fragments):
    model = make_model()
    before = snapshot(model)
    with raises_naming(exc, *fragments):
        build(model)
    assert_unchanged(before, model)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("option", ["lr", "weight_decay"])
def test_every_optimizer_rejects_negative_hyperparameters(name, option):
    model = make_model()
    before = snapshot(model)
    with raises_naming(ValueError, f"{option}=-0.1"):
        CLASSES[name](orthoptim.param_groups(model), **{option: -0.1})
    assert_unchanged(before, model)


@pytest.mark.parametrize("name", ["dion3", "dion2", "muon", "normuon"])
def test_distributed_mesh_of_the_wrong_type_names_the_argument(name):
    """distributed_mesh takes None, a ProcessGroup or a 1-D DeviceMesh; anything else is refused."""
    model = make_model()
    before = snapshot(model)
    with raises_naming(TypeError, "distributed_mesh", "ProcessGroup", "DeviceMesh"):
        CLASSES[name](orthoptim.param_groups(model), distributed_mesh=object())
    assert_unchanged(before, model)


@pytest.mark.parametrize("argument", ["replicate_mesh", "outer_shard_mesh", "inner_shard_mesh"])
def test_dion_mesh_arguments_are_refused_naming_the_argument(argument):
    """Dion's meshes are not implemented on one process (NotImplementedError); should a version accept
    some meshes, a non-mesh object must still be refused by name (TypeError)."""
    model = make_model()
    before = snapshot(model)
    with raises_naming((NotImplementedError, TypeError), argument):
        orthoptim.Dion(orthoptim.param_groups(model), **{argument: object()})
    assert_unchanged(before, model)


# ----------------------------------------------------------------------------- add_param_group
def set_grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(500 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def live_optimizer(name: str = "dion3", **kwargs):
    """An optimizer over everything but ``out``, with non-zero state after two steps."""
    model = make_model()
    groups = [g for g in orthoptim.param_groups(model, overrides={"out.*": {"algorithm": "adamw"}})
              if g["name"] != "out.*"]
    opt = CLASSES[name](groups, lr=0.02, **kwargs)
    for t in range(2):
        set_grads(model, t)
        opt.step()
    return model, opt


ADD_GROUP_CASES = [
    ("negative_lr", {"lr": -1.0}, ValueError, ["lr=-1.0", "param group 3", "must be >= 0.0;"]),
    ("num_heads", {"num_heads": 5}, ValueError, ["out.weight", "num_heads=5"]),
    ("split_sizes", {"split_sizes": [4, 5]}, ValueError, ["out.weight", "split_sizes=[4, 5]"]),
    ("algorithm", {"algorithm": "adam"}, ValueError, ["algorithm='adam'"]),
    ("mu", {"mu": 1.0}, ValueError, ["mu=1.0"]),
    ("orthogonalizer", {"orthogonalizer": "qr"}, ValueError, ["orthogonalizer", "'qr'"]),
    ("vector_param", {"with_bias": True}, ValueError, ["out.bias", "algorithm='adamw'"]),
]


@pytest.mark.parametrize(("options", "exc", "fragments"), [c[1:] for c in ADD_GROUP_CASES],
                         ids=[c[0] for c in ADD_GROUP_CASES])
def test_add_param_group_with_bad_options_leaves_existing_groups(options, exc, fragments):
    model, opt = live_optimizer()
    assert len(opt.param_groups) == 3
    before = snapshot(model, opt)
    options = dict(options)
    names = ["out.weight", "out.bias"] if options.pop("with_bias", False) else ["out.weight"]
    with raises_naming(exc, *fragments):
        opt.add_param_group(named_group(model, *names, **options))
    assert_unchanged(before, model, opt)
    assert len(opt.param_groups) == 3
    assert model.out.weight not in opt.state and model.out.bias not in opt.state

    # Still usable: a correct group can be added afterwards, and steps run.
    opt.add_param_group(named_group(model, "out.weight"))
    assert "momentum" in opt.state[model.out.weight]
    set_grads(model, 2)
    opt.step()


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("fails_at", [1, 2])
def test_add_param_group_that_fails_making_state_can_be_retried(name, fails_at, monkeypatch):
    """Out of memory while the new group's state is made (the fails_at-th parameter's): the group is
    taken out again, so the same call can be retried, and the steps then match a cleanly added group."""
    def with_extra(model):
        model.extra = nn.Linear(8, 8)
        model.extra2 = nn.Linear(8, 8)
        return ["out.weight", "extra.weight", "extra2.weight"]

    model, opt = live_optimizer(name)
    names = with_extra(model)
    before = snapshot(model, opt)
    real, calls = type(opt)._init_state, []

    def failing(self, p, group):
        calls.append(p)
        if len(calls) == fails_at:
            raise torch.OutOfMemoryError("simulated")
        return real(self, p, group)

    monkeypatch.setattr(type(opt), "_init_state", failing)
    with pytest.raises(torch.OutOfMemoryError):
        opt.add_param_group(named_group(model, *names))
    monkeypatch.setattr(type(opt), "_init_state", real)
    assert len(opt.param_groups) == 3
    assert all(dict(model.named_parameters())[n] not in opt.state for n in names)
    assert_unchanged(before, model, opt)

    opt.add_param_group(named_group(model, *names))  # the retry
    clean_model, clean = live_optimizer(name)
    clean.add_param_group(named_group(clean_model, *with_extra(clean_model)))
    for m, o in ((model, opt), (clean_model, clean)):
        for t in (2, 3):
            set_grads(m, t)
            o.step()
    for (n, a), b in zip(model.named_parameters(), clean_model.parameters(), strict=True):
        assert torch.equal(a, b), n


# ----------------------------------------------------------------------------- non-finite gradients
BAD_VALUES = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
BAD_PARAMS = ["lin.weight", "conv.weight", "norm.bias", "emb.weight"]  # matrix, flattened conv, AdamW ×2


def poison(model: nn.Module, name: str, value: float) -> None:
    """One bad entry in the middle of an otherwise finite gradient."""
    grad = dict(model.named_parameters())[name].grad
    grad.view(-1)[grad.numel() // 2] = value


@pytest.mark.parametrize("bad_param", BAD_PARAMS)
@pytest.mark.parametrize("name", list(CLASSES))
def test_nonfinite_gradient_raises_and_changes_nothing(name, bad_param):
    model, opt = live_optimizer(name)
    value = list(BAD_VALUES.values())[BAD_PARAMS.index(bad_param) % 3]
    set_grads(model, 2)
    poison(model, bad_param, value)
    before = snapshot(model, opt)
    with raises_naming(orthoptim.NonFiniteGradientError, bad_param, "nonfinite='skip'"):
        opt.step()
    assert_unchanged(before, model, opt)


@pytest.mark.skipif(not hasattr(torch.Tensor, "grad_dtype"), reason="Tensor.grad_dtype is new in torch 2.13")
@pytest.mark.parametrize("name", list(CLASSES))
def test_fp32_gradients_of_bf16_parameters_step_every_group(name):
    """torch 2.13's p.grad_dtype gives bf16 weights fp32 gradients. The fused AdamW kernel refused the
    pair after the matrix groups had stepped; now AdamW/Lion round such a gradient to the parameter's
    dtype first (the matrix rules add it into their momentum unrounded), so their parameters move
    exactly as with that rounded gradient given directly."""
    models, opts = [], []
    for _ in range(2):
        model = make_model().bfloat16()
        groups = orthoptim.param_groups(model, overrides={"norm.*": {"algorithm": "lion"}})
        models.append(model)
        opts.append(CLASSES[name](groups, lr=0.02))
    mixed, rounded = models
    for p in mixed.parameters():
        p.grad_dtype = torch.float32
    gen = torch.Generator().manual_seed(7)
    for p, q in zip(mixed.parameters(), rounded.parameters()):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g, g.bfloat16()
    for opt in opts:
        opt.step()
    for (n, p), q in zip(mixed.named_parameters(), rounded.parameters()):
        if n.startswith(("emb.", "norm.", "lin.bias", "out.bias", "conv.bias")):  # AdamW and Lion
            assert torch.equal(p, q), n
        else:  # the matrix rules add the fp32 gradient to bf16 momentum: rounded once, not twice
            torch.testing.assert_close(p.float(), q.float(), rtol=0, atol=0.02)
        assert not torch.equal(p, make_model().bfloat16().get_parameter(n)), f"{n} did not move"


def test_a_sparse_gradient_is_refused_naming_the_fix():
    model, opt = live_optimizer("dion3")
    set_grads(model, 2)
    model.emb.weight.grad = model.emb.weight.grad.to_sparse()
    before = snapshot(model, opt)
    with raises_naming(ValueError, "emb.weight", "sparse=False", "SparseAdam"):
        opt.step()
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize("value", list(BAD_VALUES))
def test_nonfinite_error_then_recovery_matches_a_run_without_the_bad_step(value):
    """After the refused step, the next finite step gives exactly what an optimizer that never saw
    the bad gradient gives: nothing half-applied is left behind, for any parameter."""
    model_a, opt_a = live_optimizer("dion3")
    model_b, opt_b = live_optimizer("dion3")
    set_grads(model_a, 2)
    poison(model_a, "lin.weight", BAD_VALUES[value])
    with pytest.raises(orthoptim.NonFiniteGradientError):
        opt_a.step()
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        set_grads(model, 3)
        opt.step()
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb), n


@pytest.mark.parametrize("capturable", [False, True])
def test_huge_finite_gradients_whose_sum_overflows_are_finite(capturable):
    """The eager CPU check sums each gradient first: entries near fp32's largest value sum to inf, and
    such a gradient must still pass (checked again exactly), while an inf next to them must not. The
    capturable step checks min and max on the device and must agree."""
    model, opt = live_optimizer("dion3", capturable=capturable)
    set_grads(model, 2)
    grad = model.lin.weight.grad
    grad.view(-1)[:4] = torch.finfo(torch.float32).max / 2
    assert not torch.isfinite(grad.sum())
    before = model.lin.weight.detach().clone()
    opt.step()
    if capturable:
        opt.check_nonfinite()  # raises if the huge gradient had been flagged
    assert torch.isfinite(model.lin.weight).all() and not torch.equal(model.lin.weight, before)
    grad.view(-1)[5] = float("inf")
    with pytest.raises(orthoptim.NonFiniteGradientError):
        opt.step()
        opt.check_nonfinite()


@pytest.mark.parametrize("capturable", [False, True])
def test_finite_float64_gradients_beyond_fp32_range_pass(capturable):
    p = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.float64))
    opt = orthoptim.Muon([p], lr=1e-310, capturable=capturable)  # tiny lr: the update stays finite
    p.grad = torch.full_like(p, 1e300)
    opt.step()
    if capturable:
        opt.check_nonfinite()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("algorithm", ["dion3", "dion", "muon", "adamw", "lion"])
def test_a_float64_gradient_beyond_the_parameters_range_is_refused(algorithm, dtype):
    """A float64 gradient (p.grad_dtype = None) is finite at 1e300 but inf in a float32 or bfloat16
    parameter's state: it was judged finite in its own dtype, and the step wrote inf/NaN into the
    weights and momentum. Refused, or skipped, before anything changes; one within range steps."""
    p = nn.Parameter(torch.randn((6,) if algorithm in ("adamw", "lion") else (6, 4), dtype=dtype))
    opt = orthoptim.Dion3([{"params": [p], "param_names": ["w"], "algorithm": algorithm}], lr=0.1)
    p.grad_dtype = None
    p.grad = torch.randn(p.shape, dtype=torch.float64)
    p.grad.view(-1)[0] = 1e300
    before = p.detach().clone()
    with raises_naming(orthoptim.NonFiniteGradientError, "parameter w", "float64", str(dtype), "p.grad_dtype"):
        opt.step()
    assert torch.equal(p, before)
    assert all(torch.isfinite(v).all() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    for group in opt.param_groups:
        group["nonfinite"] = "skip"
    with pytest.warns(UserWarning, match="parameter w has a finite float64 gradient.*skipped"):
        opt.step()
    assert torch.equal(p, before)
    p.grad.view(-1)[0] = 1e15  # within range (and its square too, which the orthogonalizers take)
    opt.step()
    assert torch.isfinite(p).all() and not torch.equal(p, before)


@pytest.mark.parametrize("capturable", [False, True])
def test_the_verdicts_index_is_kept_for_the_last_sets_of_parameters_only_when_eager(capturable):
    """Distributed, the verdict places each step's parameters with gradients by a device index, kept
    per set of them: eager steps whose set varied (layer drop, experts without tokens) added one for
    good, a leak. Eager keeps the last few; capturable keeps all (a captured graph may read one)."""
    from orthoptim.optim.nonfinite import EAGER_VERDICT_INDICES

    params = [nn.Parameter(torch.randn(4, 4)) for _ in range(3 * EAGER_VERDICT_INDICES)]
    opt = orthoptim.Dion3(params, lr=0.01, capturable=capturable)
    for k in range(1, len(params) + 1):
        some = params[-k:]
        index = opt._positions_among(some, params, torch.device("cpu"))
        assert index.tolist() == list(range(len(params) - k, len(params)))
    assert len(opt._verdict_index) == (len(params) if capturable else EAGER_VERDICT_INDICES)
    first = opt._positions_among(params, params, torch.device("cpu"))  # the most recent set: kept
    assert opt._positions_among(params, params, torch.device("cpu")) is first


def test_nonfinite_error_is_a_floating_point_error():
    assert issubclass(orthoptim.NonFiniteGradientError, FloatingPointError)


@pytest.mark.parametrize("bad_param", ["lin.weight", "norm.weight"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_nonfinite_skip_warns_and_updates_only_the_others(name, bad_param):
    model, opt = live_optimizer(name, nonfinite="skip")
    set_grads(model, 2)
    poison(model, bad_param, float("nan"))
    params = dict(model.named_parameters())
    before_params = {n: p.detach().clone() for n, p in params.items()}
    before_state = {n: _clone(opt.state[p]) for n, p in params.items() if p in opt.state}
    with pytest.warns(UserWarning, match=re.escape(bad_param)) as record:
        opt.step()
    messages = [str(w.message) for w in record if "non-finite" in str(w.message)]
    assert len(messages) == 1 and "skipped" in messages[0]
    for n, p in params.items():
        if n == bad_param or n.startswith("out."):  # the skipped one, and the one outside the optimizer
            assert torch.equal(p, before_params[n]), f"{n} should not move"
        else:
            assert not torch.equal(p, before_params[n]), f"{n} should have been updated"
        if n in before_state:
            if n == bad_param:
                _assert_equal(before_state[n], opt.state[p], f"state of {n}")
            else:
                assert any(not torch.equal(v, opt.state[p][k]) for k, v in before_state[n].items()), n


def test_nonfinite_skip_only_in_the_group_that_asks_for_it():
    """``nonfinite`` is a group option: "skip" in the AdamW group does not silence the matrix group."""
    model = make_model()
    groups = orthoptim.param_groups(model)
    for g in groups:
        if g.get("algorithm") == "adamw":
            g["nonfinite"] = "skip"
    opt = orthoptim.Dion3(groups)
    set_grads(model, 0)
    poison(model, "emb.weight", float("nan"))
    with pytest.warns(UserWarning, match="emb.weight"):
        opt.step()
    set_grads(model, 1)
    poison(model, "lin.weight", float("nan"))
    before = snapshot(model, opt)
    with raises_naming(orthoptim.NonFiniteGradientError, "lin.weight"):
        opt.step()
    assert_unchanged(before, model, opt)


# ----------------------------------------------------------------------------- unknown group keys
def test_misspelled_group_key_warns_naming_it():
    model = make_model()
    with pytest.warns(UserWarning, match="'weight_decy'") as record:
        opt = orthoptim.Muon([named_group(model, "lin.weight", weight_decy=0.1)])
    assert any("spelling" in str(w.message) for w in record)
    assert opt.param_groups[0]["weight_decay"] == opt.defaults["weight_decay"]  # the typo set nothing


def test_a_bare_conv1d_weight_warns_that_it_is_read_as_a_batch():
    """A Conv1d weight [out, in, k] given without param_groups was read silently as out matrices of
    [in, k] (a 3-D parameter is a batch of matrices): warned, naming it and the fix; not for groups
    that say flatten either way, param_groups' own, or experts whose matrices are wide."""
    conv = nn.Conv1d(4, 8, 3)
    with pytest.warns(UserWarning, match=r"conv: 3-D .* \(8, 4, 3\) is read as 8 matrices of \[4, 3\].*flatten=True"):
        orthoptim.Muon([{"params": [conv.weight], "param_names": ["conv: 3-D"]}])
    experts = nn.Parameter(torch.randn(4, 16, 32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for flatten in (False, True):
            orthoptim.Muon([{"params": [conv.weight], "flatten": flatten}])
        orthoptim.Dion3(orthoptim.param_groups(nn.Sequential(conv)))
        orthoptim.Dion3([experts])
        small = nn.Module()
        small.experts = nn.Parameter(torch.randn(4, 16, 4))  # tiny experts: param_groups says what they are
        orthoptim.Dion3(orthoptim.param_groups(small))
        orthoptim.Dion3([{"params": [small.experts], "transpose": True}])


def test_misspelled_key_in_add_param_group_warns_naming_it():
    model, opt = live_optimizer()
    with pytest.warns(UserWarning, match="'lr_scale'"):
        opt.add_param_group(named_group(model, "out.weight", lr_scale=2.0))


def test_known_keys_do_not_warn():
    """No false alarms: param_groups output (name, param_names) and every option each algorithm reads."""
    model = make_model()
    dion3_options = dict(lr=0.01, weight_decay=0.0, mu=0.9, fraction=0.5, muon_beta2=0.9, adjust_lr="rms_norm",
                         orthogonalizer="gram", flatten=False, nonfinite="skip", selection_scope="global",
                         epsilon=1e-7, algorithm="dion3")
    dion_options = dict(rank_fraction=0.5, qr_method="qr", epsilon=1e-7, mu=0.9, algorithm="dion")
    groups = orthoptim.param_groups(model, overrides={"lin.weight": {"num_heads": 2, "split_sizes": [2, 4]},
                                                      "out.weight": dion3_options, "conv.weight": dion_options},
                                    scalar_lr=0.01)
    extra = [("adamw", {"betas": (0.8, 0.9), "epsilon": 1e-6}, 3), ("lion", {"betas": (0.8, 0.9)}, 3),
             ("normuon", {"nesterov": False, "muon_beta2": 0.9, "epsilon": 1e-6}, (3, 4))]
    for algorithm, options, shape in extra:
        groups.append({"params": [torch.nn.Parameter(torch.zeros(shape))], "param_names": [f"extra_{algorithm}"],
                       "algorithm": algorithm, **options})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        orthoptim.Dion3(groups)


@pytest.mark.parametrize(("algorithm", "key", "value", "readers"), [
    ("muon", "fraction", 0.5, "dion3, dion2"),
    ("dion3", "rank_fraction", 0.25, "dion"),
    ("dion3", "betas", (0.8, 0.9), "adamw, lion"),
    ("adamw", "mu", 0.9, "dion3, dion2, dion, muon, normuon"),
    ("lion", "epsilon", 1e-6, "dion3, dion, normuon, adamw"),
])
def test_options_the_groups_algorithm_does_not_read_are_named(algorithm, key, value, readers):
    """fraction on a Muon group is a known key but changes nothing: most likely meant for another group."""
    p = torch.nn.Parameter(torch.zeros(4, 6))
    with pytest.warns(UserWarning, match=rf"param group 0 sets {key}=.*algorithm='{algorithm}' does not read "
                                         rf"\(it is read by {readers}\)"):
        orthoptim.Dion3([{"params": [p], "algorithm": algorithm, key: value}])


def test_an_option_of_the_optimizer_that_a_group_does_not_read_is_no_warning():
    """Dion3(fraction=0.5) with a Muon group: the option is the optimizer's, for the groups that read it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        orthoptim.Dion3([{"params": [torch.nn.Parameter(torch.zeros(4, 6))], "algorithm": "muon"}], fraction=0.5)


def test_param_groups_flattens_a_conv_for_matrix_rules_only():
    """flatten=True follows the conv's algorithm after the overrides: none for AdamW, one for Muon even
    when the other matrices go to AdamW."""
    model = make_model()
    for kwargs, flattened in (({"overrides": {"conv.weight": {"algorithm": "adamw"}}}, False),
                              ({"algorithm": "adamw"}, False),
                              ({"algorithm": "adamw", "overrides": {"conv.weight": {"algorithm": "muon"}}}, True)):
        groups = orthoptim.param_groups(model, **kwargs)
        conv = next(g for g in groups if "conv.weight" in g["param_names"])
        assert conv.get("flatten", False) is flattened, kwargs
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            orthoptim.Dion3(groups).step()  # no gradients: nothing moves, but every group is built


def test_numpy_scalars_are_numbers():
    np = pytest.importorskip("numpy")
    model = make_model()
    opt = orthoptim.Dion3([named_group(model, "lin.weight")], lr=np.float32(0.02), fraction=np.float64(0.5))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)


def test_param_groups_override_that_is_not_a_dict_is_named():
    with raises_naming(ValueError, "overrides['lin.weight']=3", "dict of group options"):
        orthoptim.param_groups(make_model(), overrides={"lin.weight": 3})


# ----------------------------------------------------------------------------- a user's orthogonalizer
@pytest.mark.parametrize("name", ["dion3", "dion2", "muon", "normuon"])
@pytest.mark.parametrize(("orthogonalizer", "fragments"), [
    (lambda u: u[..., :1, :], ["returned (1, 1, 8)", "batch of shape (1, 6, 8)", "same shape"]),
    (lambda u: torch.full_like(u, float("nan")), ["non-finite values", "finite batch"]),
    (lambda u: u.tolist(), ["returned list"]),
    (lambda u: 1 / 0, ["raised ZeroDivisionError"]),
], ids=["broadcastable_shape", "nan", "not_a_tensor", "raises"])
def test_orthogonalizer_output_is_checked_and_named(name, orthogonalizer, fragments):
    """A wrong shape would broadcast into every row and NaNs would reach the weights, both silently."""
    model = make_model()
    every_row = {"fraction": 1.0} if name in ("dion2", "dion3") else {}
    opt = CLASSES[name]([named_group(model, "lin.weight", orthogonalizer=orthogonalizer, **every_row)])
    set_grads(model, 0)
    before = model.lin.weight.detach().clone()
    with raises_naming(ValueError, "orthogonalizer", "lin.weight", "zero update", "restore", *fragments) as info:
        opt.step()
    # What the callable raised is the error's cause (an out-of-memory error stays visible as one).
    raised = "ZeroDivisionError" in fragments[0]
    assert isinstance(info.value.__cause__, ZeroDivisionError) if raised else info.value.__cause__ is None
    # The failing batch got a zero update: only the weight decay moved the parameter, nothing non-finite.
    group = opt.param_groups[0]
    torch.testing.assert_close(model.lin.weight, before * (1 - group["lr"] * group["weight_decay"]))


def test_a_step_that_failed_half_way_leaves_no_orthogonalizer_problem_for_the_next():
    """A user's orthogonalizer raised, then the step failed before its end (here: the second group):
    the next step's error named the old problem and chained its exception."""
    model = make_model()
    calls = []

    def fails_once(u):
        calls.append(1)
        if len(calls) == 1:
            raise ZeroDivisionError("from the first step")
        return orthoptim.orthogonalize.svd_polar(u)

    opt = orthoptim.Muon([named_group(model, "lin.weight", orthogonalizer=fails_once),
                          named_group(model, "out.weight")], lr=0.02)
    set_grads(model, 0)
    real = type(opt)._matrix_step

    def second_group_fails(self, group, params):
        if group is self.param_groups[1]:
            raise RuntimeError("out of memory (simulated)")
        return real(self, group, params)

    type(opt)._matrix_step = second_group_fails
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            opt.step()
    finally:
        type(opt)._matrix_step = real
    opt.step()  # the orthogonalizer works now: no error from the first step's failure


def test_an_optimizer_pickled_before_the_orthogonalizer_error_existed_still_names_failures():
    model = make_model()
    opt = orthoptim.Muon([named_group(model, "lin.weight", orthogonalizer=lambda u: 1 / 0)], lr=0.02)
    del opt.__dict__["_orthogonalizer_error"]  # as an optimizer pickled by an earlier version
    opt = copy.deepcopy(opt)
    (p,) = opt.param_groups[0]["params"]
    p.grad = torch.ones_like(p)
    with raises_naming(ValueError, "raised ZeroDivisionError"):
        opt.step()


def test_a_correct_orthogonalizer_callable_passes_the_checks():
    model = make_model()
    def exact(u):  # a user's function (this module's), so its output is checked
        return orthoptim.orthogonalize.svd_polar(u)

    opt = orthoptim.Dion3([named_group(model, "lin.weight", orthogonalizer=exact)])
    set_grads(model, 0)
    opt.step()
    assert torch.isfinite(model.lin.weight).all()


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_batch_of_zero_matrices_is_a_no_op(name):
    """An empty expert batch [0, m, n] (e.g. no experts on this shard): nothing to update, no error."""
    empty, weight = nn.Parameter(torch.zeros(0, 4, 5)), nn.Parameter(torch.randn(4, 5))
    opt = CLASSES[name]([empty, weight])
    empty.grad, weight.grad = torch.zeros_like(empty), torch.randn_like(weight)
    before = weight.detach().clone()
    opt.step()
    assert empty.shape == (0, 4, 5) and not torch.equal(weight, before)


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("lr", float("inf"), "lr=inf in param group 1 (at step time)"),
    ("fraction", 2.0, "fraction=2.0 in param group 1 (at step time)"),
    ("muon_beta2", 1.5, "muon_beta2=1.5 in param group 1 (at step time)"),
    ("nonfinite", "rasie", "nonfinite='rasie' in param group 1 (at step time)"),
])
def test_options_changed_between_steps_are_checked_before_the_step(key, value, fragment):
    """A schedule or a hand edit that sets a bad value is refused before anything moves."""
    model, opt = live_optimizer()
    assert opt.param_groups[1]["algorithm"] == "dion3"
    opt.param_groups[1][key] = value
    set_grads(model, 1)
    before = snapshot(model, opt)
    with raises_naming(ValueError, fragment):
        opt.step()
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize(("value", "fragment"), [(float("nan"), "lr=nan"), (float("inf"), "lr=inf"),
                                               (-0.5, "lr=-0.5")])
def test_a_tensor_lr_filled_with_a_bad_value_is_refused_before_the_step(value, fragment):
    """Schedulers fill a tensor lr in place; a CPU one is read at each eager step (it costs no sync)."""
    model, opt = live_optimizer()
    opt.param_groups[1]["lr"] = torch.tensor(0.02)
    opt.step()
    opt.param_groups[1]["lr"].fill_(value)
    set_grads(model, 1)
    before = snapshot(model, opt)
    with raises_naming(ValueError, fragment, "param group 1 (at step time)"):
        opt.step()
    assert_unchanged(before, model, opt)
    opt.param_groups[1]["lr"].fill_(0.02)
    opt.step()


@pytest.mark.parametrize("name", ["dion", "muon"])
@pytest.mark.parametrize("lr", [torch.tensor([0.02]), torch.tensor(1)], ids=["1-d", "integer"])
def test_a_tensor_lr_that_is_not_a_0_dim_float_is_refused_at_step_time_as_at_construction(name, lr):
    """A one-element 1-D tensor set after construction was read as a number by the step-time check,
    then the matrix rule raised after the AdamW group had stepped."""
    model, opt = live_optimizer(name)
    for group in opt.param_groups:
        group["lr"] = lr
    set_grads(model, 1)
    before = snapshot(model, opt)
    with raises_naming(ValueError, "param group 0 (at step time)", "0-dim floating-point tensor"):
        opt.step()
    assert_unchanged(before, model, opt)
    # explain formats it as a number (a 1-D tensor raised): the lr column of a scalar parameter's row
    row = next(line for line in orthoptim.explain(opt).splitlines() if line.startswith("lin.bias"))
    assert row.split()[4] == f"{float(lr):.3g}"


@pytest.mark.parametrize(("name", "group", "edit", "fragments"), [
    ("dion3", 2, {"num_heads": 3}, ["conv.weight", "num_heads=3"]),
    ("dion3", 2, {"split_sizes": [1, 2]}, ["conv.weight", "split_sizes=[1, 2]"]),
    ("dion3", 2, {"flatten": False}, ["conv.weight", "flatten=True"]),
    ("dion3", 0, {"algorithm": "dion3"}, ["lin.bias", "algorithm='adamw'"]),
    ("dion", 2, {"num_heads": 2}, ["conv.weight", "state 'Q'", "num_heads=2"]),
    ("dion", 2, {"rank_fraction": 0.5}, ["conv.weight", "state 'Q'", "rank_fraction=0.5"]),
])
def test_edits_that_do_not_fit_a_parameter_are_refused_before_any_group_steps(name, group, edit, fragments):
    """Options whose check needs the parameters (num_heads, split_sizes, flatten, a matrix rule on a vector)
    or that no longer fit the state already made (Dion's right factors Q) are checked for every group
    before the first one is stepped: the groups before the edited one stay as they were too."""
    model, opt = live_optimizer(name)
    opt.param_groups[group].update(edit)
    set_grads(model, 2)
    before = snapshot(model, opt)
    with raises_naming(ValueError, *fragments):
        opt.step()
    assert_unchanged(before, model, opt)


def _resize_lin(model: nn.Module) -> None:
    model.lin.weight.data = torch.randn(2 * model.lin.weight.shape[0], model.lin.weight.shape[1])


def _slice_lin(model: nn.Module) -> None:  # the same storage, fewer rows
    model.lin.weight.data = model.lin.weight.data[: model.lin.weight.shape[0] // 2]


def _view_lin(model: nn.Module) -> None:  # the same storage and size, another shape
    model.lin.weight.data = model.lin.weight.data.view(model.lin.weight.shape[1], -1)


def _transpose_conv(model: nn.Module) -> None:  # the same storage, shape and size: another layout
    model.conv.weight.data = model.conv.weight.data.transpose(2, 3)  # 3×3 kernels: the shape stays


@pytest.mark.parametrize(("change", "fragments"), [
    (_resize_lin, ["lin.weight", "parameter's shape"]),
    (_slice_lin, ["lin.weight", "parameter's shape"]),
    (_view_lin, ["lin.weight", "parameter's shape"]),
    (_transpose_conv, ["conv.weight", "not contiguous"]),
    (lambda model: model.to(torch.bfloat16), ["bfloat16", "its state", "load_state_dict"]),
    (lambda model: model.to(memory_format=torch.channels_last), ["conv.weight", "not contiguous"]),
])
@pytest.mark.parametrize("name", ["dion3", "muon", "dion"])
def test_parameters_changed_after_a_step_are_checked_again_before_the_next(name, change, fragments):
    """Checks that passed once were not redone for the same options: a parameter resized, converted or
    laid out channels_last after a step failed half-way through the next one, with a raw error, after
    other groups had been stepped."""
    model, opt = live_optimizer(name)
    change(model)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = snapshot(model, opt)
    with raises_naming(ValueError, *fragments):
        opt.step()
    assert_unchanged(before, model, opt)


@pytest.mark.parametrize("name", ["dion3", "muon", "dion"])
def test_a_parameter_reinterpreted_in_another_dtype_on_the_same_storage_is_checked_again(name):
    """bf16 → fp16 by .view keeps storage, shape and layout: the step once skipped its checks and ran
    fp16 weights against bf16 state (or failed half-way)."""
    weight = nn.Parameter(torch.randn(6, 8).to(torch.bfloat16))
    bias = nn.Parameter(torch.randn(6).to(torch.bfloat16))
    opt = CLASSES[name]([{"params": [bias], "algorithm": "adamw"}, {"params": [weight]}], lr=0.02)
    for p in (weight, bias):
        p.grad = torch.randn_like(p)
    opt.step()
    weight.data = weight.data.view(torch.float16)
    weight.grad = torch.randn_like(weight)
    bias_before, state_before = bias.detach().clone(), _clone(opt.state_dict())
    with raises_naming(ValueError, "torch.float16", "its state"):
        opt.step()
    assert torch.equal(bias, bias_before)
    _assert_equal(state_before, opt.state_dict(), "optimizer.state_dict()")


def test_a_parameter_swapped_into_a_group_by_hand_is_refused_even_on_the_same_storage():
    """model.load_state_dict(..., assign=True) gives a model new Parameters; putting them into the
    optimizer's groups by hand (sharing the old ones' storage) once stepped them on fresh state."""
    _, opt = live_optimizer("dion")
    group = opt.param_groups[1]
    group["params"] = [nn.Parameter(p.data) for p in group["params"]]
    for p in group["params"]:
        p.grad = torch.randn_like(p)
    with raises_naming(ValueError, "param group 1", "add_param_group"):
        opt.step()


def test_a_parameter_put_into_a_group_by_hand_is_refused_by_the_step():
    model, opt = live_optimizer("dion")
    extra = nn.Parameter(torch.randn(6, 4))
    opt.param_groups[1]["params"].append(extra)
    set_grads(model, 2)
    extra.grad = torch.randn_like(extra)
    before = snapshot(model)
    with raises_naming(ValueError, "param group 1", "add_param_group"):
        opt.step()
    assert_unchanged(before, model)


def test_capturable_only_options_are_checked_at_step_time_too():
    model, opt = live_optimizer(capturable=True)
    opt.param_groups[1]["nonfinite"] = "skip"
    set_grads(model, 2)
    before = snapshot(model, opt)
    with raises_naming(ValueError, "param group 1 (at step time)", "nonfinite='skip'", "capturable=True"):
        opt.step()
    assert_unchanged(before, model, opt)


def test_a_capturable_group_refused_for_its_devices_is_not_added():
    weight = nn.Parameter(torch.randn(4, 4))
    opt = orthoptim.Dion3([weight], capturable=True)
    other, on_meta = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4, device="meta"))
    with raises_naming(ValueError, "param group 1", "on one device"):
        opt.add_param_group({"params": [other, on_meta]})
    assert len(opt.param_groups) == 1 and other not in opt.state
    opt.add_param_group({"params": [other]})  # the same parameter, now alone, is accepted
    assert len(opt.param_groups) == 2 and isinstance(opt.param_groups[1]["lr"], torch.Tensor)


@pytest.mark.parametrize("name", ["adamw", "lion", "dion", "dion3"])
def test_capturable_float64_steps_keep_float64_learning_rates(name):
    """A capturable group's lr tensor is as wide as its parameters: fp64 steps equal eager fp64 steps."""
    gen = torch.Generator().manual_seed(3)
    shape = (6,) if name in ("adamw", "lion") else (6, 5)
    x0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    results = []
    for capturable in (False, True):
        p = nn.Parameter(x0.clone())
        cls = orthoptim.Dion if name == "dion" else orthoptim.Dion3
        opt = cls([{"params": [p], "algorithm": name}], lr=0.0123, weight_decay=0.1, capturable=capturable)
        if capturable:
            assert opt.param_groups[0]["lr"].dtype == torch.float64
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results.append(p.detach().clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=1e-14)


def test_a_fraction_schedule_between_steps_is_followed():
    model, opt = live_optimizer("dion3", weight_decay=0.0)
    for fraction, rows in ((1.0, 6), (0.5, 3), (0.25, 2)):  # lin.weight has 6 rows: ceil(f·6) move
        opt.param_groups[1]["fraction"] = fraction
        before = model.lin.weight.detach().clone()
        set_grads(model, 0)
        opt.step()
        assert int((model.lin.weight != before).any(dim=1).sum()) == rows, fraction


# ----------------------------------------------------------------------------- fp16 momentum overflow
def _fp16_step(name: str, grads: list[float], **options):
    """A float16 matrix stepped with constant gradients; returns the parameter and the optimizer."""
    p = nn.Parameter(torch.full((4, 8), 0.1, dtype=torch.float16))
    opt = CLASSES[name]([{"params": [p], "param_names": ["w16"]}], lr=0.01, **options)
    for value in grads[:-1]:
        p.grad = torch.full_like(p, value)
        opt.step()
    p.grad = torch.full_like(p, grads[-1])
    return p, opt


@pytest.mark.parametrize("name", list(CLASSES))
def test_fp16_momentum_overflow_is_refused_before_the_step(name):
    """Finite gradients of 4e4: M + G (or, for Dion, B Q) exceeds fp16's 65504 on the second step,
    which turned every weight into NaN without an error."""
    grads = [1.0, 4e4] if name == "dion" else [4e4, 4e4]
    p, opt = _fp16_step(name, grads)
    before = (p.detach().clone(), _clone(opt.state_dict()))
    with raises_naming(orthoptim.NonFiniteGradientError, "w16", "overflow float16", "no parameter or state"):
        opt.step()
    assert torch.equal(p, before[0])
    _assert_equal(before[1], opt.state_dict())


@pytest.mark.parametrize("name", list(CLASSES))
def test_fp16_momentum_overflow_is_skipped_with_a_warning(name):
    p, opt = _fp16_step(name, [1.0, 4e4] if name == "dion" else [4e4, 4e4], nonfinite="skip")
    before = p.detach().clone()
    with pytest.warns(UserWarning, match="w16.*overflow float16"):
        opt.step()
    assert torch.equal(p, before) and torch.isfinite(p).all()


@pytest.mark.parametrize("name", list(CLASSES))
def test_fp16_momentum_that_fits_steps_normally(name):
    p, opt = _fp16_step(name, [100.0, 100.0, 100.0])
    opt.step()
    assert torch.isfinite(p).all()


@pytest.mark.parametrize("name", ["dion3", "dion2"])
def test_fp16_dion2_and_dion3_check_bounds_the_momentum_before_its_decay(name):
    """Dion2/Dion3 accumulate M ← M + G and decay only the selected rows afterwards: |M + G| = 66000
    overflows fp16 although |0.95·M + G| = 63000 would not. A check that applied μ first let the step
    write inf into the momentum."""
    p = nn.Parameter(torch.zeros(8, 16, dtype=torch.float16))
    opt = CLASSES[name]([{"params": [p], "param_names": ["w16"]}], lr=0.01, fraction=0.25, mu=0.95)
    opt.state[p]["momentum"].fill_(60000.0)  # rows left unselected for many steps
    p.grad = torch.full_like(p, 6000.0)
    before = (p.detach().clone(), _clone(opt.state_dict()))
    with raises_naming(orthoptim.NonFiniteGradientError, "w16", "overflow float16"):
        opt.step()
    assert torch.equal(p, before[0])
    _assert_equal(before[1], opt.state_dict())


def test_a_users_factored_orthogonalizer_is_checked_too():
    """Muon lets a callable's ``factored`` form write the last product into the weights: checked alike."""
    def exact(u):
        return orthoptim.orthogonalize.svd_polar(u)

    exact.factored = lambda u: orthoptim.orthogonalize.PolarFactors(
        torch.full((u.shape[0], 6, 6), float("nan")), u.mT.contiguous() if u.shape[-2] > u.shape[-1] else u,
        u.shape[-2] > u.shape[-1])
    model = make_model()
    opt = orthoptim.Muon([named_group(model, "lin.weight", orthogonalizer=exact)])
    set_grads(model, 0)
    with raises_naming(ValueError, "non-finite factors", "lin.weight", "zero update"):
        opt.step()
    assert torch.isfinite(model.lin.weight).all()


def test_fp16_overflow_is_checked_on_the_matrices_dion_works_on():
    """A flattened conv weight [256, 4, 3] is one 256×12 matrix: its columns' norms overflow fp16 in
    Bᵀ P (5000·√256 = 80000), which per-[4, 3]-slice norms missed."""
    p = nn.Parameter(torch.full((256, 4, 3), 0.01, dtype=torch.float16))
    opt = orthoptim.Dion([{"params": [p], "param_names": ["conv"], "flatten": True}], rank_fraction=0.5)
    p.grad = torch.full_like(p, 5000.0)
    with raises_naming(orthoptim.NonFiniteGradientError, "conv", "overflow float16"):
        opt.step()


@pytest.mark.parametrize("mu", [0.9, 0.95])
@pytest.mark.parametrize("name", ["muon", "normuon"])
def test_fp16_nesterov_check_refuses_exactly_the_steps_that_would_overflow(name, mu, monkeypatch):
    """Near fp16's limit, with Nesterov: a step is refused exactly when, unchecked, it would turn the
    weights into NaN (M ← G + μM, then B = G + μM, each rounded as the rule rounds)."""
    def outcome(m0: float, g0: float, checked: bool) -> str:
        p = nn.Parameter(torch.full((4, 8), 0.1, dtype=torch.float16))
        opt = CLASSES[name]([{"params": [p], "param_names": ["w16"]}], lr=0.01, mu=mu, nesterov=True)
        opt.state[p]["momentum"].fill_(m0)
        p.grad = torch.full_like(p, g0)
        if not checked:
            monkeypatch.setattr(type(opt), "_momentum_fits", lambda self, params, groups, device: torch.ones(
                len(params), dtype=torch.bool, device=device))
        try:
            opt.step()
        except orthoptim.NonFiniteGradientError:
            return "refused"
        finally:
            monkeypatch.undo()
        return "finite" if torch.isfinite(p).all() else "nan"

    grid = [(m0, g0) for m0 in torch.linspace(63000, 65504, 12).half().tolist()
            for g0 in torch.linspace(65504 * (1 - mu) * 0.9, 65504 * (1 - mu) * 1.1, 9).half().tolist()]
    seen = set()
    for m0, g0 in grid:
        unchecked = outcome(m0, g0, checked=False)
        assert unchecked != "refused"
        assert outcome(m0, g0, checked=True) == ("refused" if unchecked == "nan" else "finite"), (m0, g0)
        seen.add(unchecked)
    assert seen == {"nan", "finite"}  # the grid straddles the limit


@pytest.mark.parametrize("blocks", [{"num_heads": 4}, {"split_sizes": [16, 16, 32]}], ids=["heads", "splits"])
def test_fp16_dion_check_measures_each_block(blocks):
    """Dion orthogonalizes each head or split: their column norms (≤ 1e4·√32), not the whole matrix's
    (1e4·√64 = 80000), bound its products. The same matrix without blocks does overflow."""
    for options, overflows in ((blocks, False), ({}, True)):
        p = nn.Parameter(torch.zeros(64, 16, dtype=torch.float16))
        opt = orthoptim.Dion([{"params": [p], "param_names": ["qkv"], **options}], rank_fraction=0.5)
        p.grad = torch.full_like(p, 1e4)
        if overflows:
            with raises_naming(orthoptim.NonFiniteGradientError, "qkv", "overflow float16"):
                opt.step()
        else:
            opt.step()
            assert torch.isfinite(p).all()


def test_a_channels_last_conv_weight_is_refused_with_the_conversion_to_make():
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    with raises_naming(ValueError, "weight", "not contiguous", "channels_last",
                       "model.to(memory_format=torch.contiguous_format)"):
        orthoptim.Dion3(orthoptim.param_groups(conv))
    conv = conv.to(memory_format=torch.contiguous_format)  # the conversion the message names works
    orthoptim.Dion3(orthoptim.param_groups(conv))


def test_a_set_of_params_is_refused_as_torch_optim_refuses_it():
    """A set's order changes between runs, and with it the state dict's order and Dion's initial Q."""
    with raises_naming(TypeError, "param group 0", "set", "list"):
        orthoptim.Muon([{"params": {nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 8))}}])
    with raises_naming(TypeError, "params is a set", "list"):
        orthoptim.Muon(frozenset({nn.Parameter(torch.randn(4, 4))}))


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "100"])
def test_a_bad_replica_sync_every_is_refused_by_name(value):
    with raises_naming(ValueError, f"replica_sync_every={value!r}", "positive number of steps", "None"):
        orthoptim.Dion([nn.Parameter(torch.randn(4, 4))], replica_sync_every=value)


def test_a_scheduler_cycling_betas_of_a_matrix_group_is_told_the_rule_reads_mu():
    """OneCycleLR (cycle_momentum=True by default) writes betas[0] into every group; the matrix rules
    read mu, so the cycle would silently do nothing there: one warning per such group, none for AdamW."""
    model = make_model()
    opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.02)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=6)
    matrix_groups = {i for i, g in enumerate(opt.param_groups) if g["algorithm"] == "dion3"}
    messages = []
    for _ in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        messages += [str(w.message) for w in caught]
        schedule.step()
    warned = {int(re.match(r"param group (\d+): betas changed", m).group(1)) for m in messages}
    assert warned == matrix_groups and len(messages) == len(matrix_groups)
    assert all("reads mu, not betas" in m and "cycle_momentum=False" in m for m in messages)
    assert all(g["mu"] == 0.95 for g in opt.param_groups if g["algorithm"] == "dion3")  # untouched


def test_steady_betas_are_not_warned_about():
    model = make_model()
    opt = orthoptim.Muon(orthoptim.param_groups(model), lr=0.02)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            schedule.step()


def _lion_for_norms(name: str):
    """live_optimizer's groups with the norm's parameters in a Lion group of their own (group 3)."""
    model, opt = live_optimizer(name)
    norms = [p for n, p in model.named_parameters() if n.startswith("norm.")]
    opt.param_groups[0]["params"] = [p for p in opt.param_groups[0]["params"] if all(p is not q for q in norms)]
    opt.add_param_group({"params": norms, "algorithm": "lion"})
    return model, opt


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_tensor_lr_on_another_device_is_refused_before_any_group_steps(name):
    """Read by its device, not its value (reading a GPU lr would sync): on another device than the
    parameters', the fused AdamW kernel raised after the step counts had moved, a matrix rule raised
    with its momenta updated and the parameters not, and Lion stepped with garbage (meta has no data)."""
    model, opt = _lion_for_norms(name)
    for index in range(len(opt.param_groups)):
        set_grads(model, 3)
        before = snapshot(model, opt)  # with the lr as it was: a meta tensor cannot be compared
        saved = opt.param_groups[index]["lr"]
        opt.param_groups[index]["lr"] = torch.tensor(0.02, device="meta")
        with raises_naming(ValueError, f"lr in param group {index} (at step time)", "meta", "cpu",
                           "put the lr on their device"):
            opt.step()
        opt.param_groups[index]["lr"] = saved
        assert_unchanged(before, model, opt)
    opt.step()  # and steps again once it is back
    with raises_naming(ValueError, "lr in the optimizer's defaults", "meta"):
        CLASSES[name](make_model().parameters(), lr=torch.tensor(0.02, device="meta"))
    with raises_naming(ValueError, f"lr in param group {len(opt.param_groups)}", "meta", "parameters' device"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "algorithm": "adamw",
                             "lr": torch.tensor(0.02, device="meta")})
    groups = len(opt.param_groups)
    with raises_naming(ValueError, f"lr in param group {groups}", "on cpu", "parameters are on meta"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, device="meta"))], "algorithm": "adamw",
                             "lr": torch.tensor(0.02)})
    assert len(opt.param_groups) == groups


@pytest.mark.parametrize("where", ["same group", "another group"])
def test_a_parameter_put_into_a_group_again_by_hand_is_refused_at_step_time(where):
    """add_param_group refuses a parameter it already has; one appended to group['params'] by hand
    was stepped twice (twice its update, or a Muon and an AdamW update)."""
    model, opt = live_optimizer("muon")
    weight = opt.param_groups[1]["params"][0]
    opt.param_groups[1 if where == "same group" else 0]["params"].append(weight)
    set_grads(model, 3)
    before = snapshot(model, opt)
    fragments = ["lin.weight twice"] if where == "same group" else ["param group 0", "so does param group 1"]
    with raises_naming(ValueError, "(at step time)", *fragments, "remove the copy"):
        opt.step()
    assert_unchanged(before, model, opt)
    opt.param_groups[1 if where == "same group" else 0]["params"].pop()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64], ids=str)
def test_a_gradient_of_a_non_float_dtype_is_refused_by_name(dtype):
    """torch lets a gradient of any dtype through once p.grad_dtype is None: an integer one was
    stepped with, a complex one failed inside the finite check without a name."""
    model, opt = live_optimizer("dion3")
    weight = model.lin.weight
    if not hasattr(weight, "grad_dtype"):
        pytest.skip("this torch checks a gradient's dtype itself (no p.grad_dtype)")
    set_grads(model, 3)
    weight.grad_dtype = None
    weight.grad = weight.grad.to(dtype)
    before = snapshot(model, opt)
    with raises_naming(ValueError, "lin.weight", str(dtype), "real floating point"):
        opt.step()
    assert_unchanged(before, model, opt)


def _model_and_opt(name, dtype=None, *, build_first, capturable=False):
    model = make_model()
    if not build_first and dtype is not None:
        model.to(dtype)
    opt = CLASSES[name](orthoptim.param_groups(model), lr=0.02, capturable=capturable)
    if build_first and dtype is not None:
        model.to(dtype)
    return model, opt


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", list(CLASSES))
def test_a_model_converted_after_the_optimizer_was_built_trains_as_if_built_after(name, dtype, capturable):
    """model.to(dtype) between the constructor and the first step (torch.optim's lazily made state
    allows it): the state the constructor made is made again for the converted parameters, so the
    steps equal those of an optimizer built after the conversion (it was refused at the first step)."""
    runs = []
    for build_first in (True, False):
        model, opt = _model_and_opt(name, dtype, build_first=build_first, capturable=capturable)
        for t in range(3):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t)).to(dtype)
            opt.step()
        assert all(v.dtype in (dtype, torch.float32, torch.float64) for st in opt.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor))
        runs.append((model, opt))
    (a, opt_a), (b, opt_b) = runs
    # A capturable lr made an fp32 tensor keeps its fp32 rounding of 0.02 when made fp64 for fp64
    # parameters (one built after the conversion rounds 0.02 to fp64 directly): 1e-8 apart.
    exact = not (capturable and dtype == torch.float64)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        if exact:
            assert torch.equal(pa, pb), n
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-7, atol=1e-9, msg=n)
    for ga, gb in zip(opt_a.param_groups, opt_b.param_groups, strict=True):
        if capturable:
            assert (ga["lr"].dtype, ga["lr"].device) == (gb["lr"].dtype, gb["lr"].device)
        torch.testing.assert_close(torch.as_tensor(ga["lr"]), torch.as_tensor(gb["lr"]), rtol=1e-7, atol=0)


def test_a_conversion_before_a_first_step_without_some_gradients_still_makes_all_state():
    """The state is made again for every parameter, not only those with a gradient in the first step
    (a frozen layer, layer drop): a distributed checkpoint saves and loads every parameter's state."""
    model, opt = _model_and_opt("dion3", torch.bfloat16, build_first=True)
    fresh_model, fresh = _model_and_opt("dion3", torch.bfloat16, build_first=False)
    for m in (model, fresh_model):
        for name, p in m.named_parameters():
            p.grad = None if name.startswith("lin.") else torch.ones_like(p)
    opt.step()
    fresh.step()
    assert set(opt.state) == set(model.parameters())
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert sorted(opt.state[p]) == sorted(fresh.state[q])
        assert all(torch.equal(opt.state[p][k], fresh.state[q][k]) for k in opt.state[p])


def test_a_first_step_refused_for_a_bad_option_after_a_conversion_changes_nothing():
    model, opt = _model_and_opt("dion", torch.float64, build_first=True)
    held = {p: dict(st) for p, st in opt.state.items()}
    matrices = next(g for g in opt.param_groups if g["algorithm"] == "dion")
    matrices["rank_fraction"] = 2.0
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with raises_naming(ValueError, "rank_fraction=2.0"):
        opt.step()
    assert all(opt.state[p][k] is v for p, st in held.items() for k, v in st.items())
    matrices["rank_fraction"] = 1.0
    opt.step()  # now made again, then stepped
    assert all(v.dtype in (torch.float64, torch.float32) for st in opt.state.values() for v in st.values())


@pytest.mark.parametrize("name", ["dion3", "dion"])
def test_a_transpose_edited_before_the_first_step_makes_the_per_row_state_again(name):
    """Square matrices' per-row state has the same shape either way: before a first step it is made
    again under the new transpose (after steps the step refuses it)."""
    p = nn.Parameter(torch.randn(8, 8))
    q = nn.Parameter(p.detach().clone())
    edited = CLASSES[name]([p], lr=0.02)
    edited.param_groups[0]["transpose"] = True
    built = CLASSES[name]([{"params": [q], "transpose": True}], lr=0.02)
    for opt, w in ((edited, p), (built, q)):
        for t in range(2):
            w.grad = torch.randn(8, 8, generator=torch.Generator().manual_seed(t))
            opt.step()
    assert torch.equal(p, q)


def _ported_run(name, how, *, reference):
    """Two steps of an optimizer whose lin.weight momentum was set by hand before its first step
    (porting a run: docs/porting.md), after one of the conversions ``how`` names."""
    model = make_model()
    buf = torch.randn(model.lin.weight.shape, generator=torch.Generator().manual_seed(5))
    convert = {"replaced": lambda m: m.to(torch.bfloat16), "other_converted": lambda m: m.norm.to(torch.float64),
               "replaced_then_converted": lambda m: m.to(torch.bfloat16)}[how]
    if reference:  # built after the conversion, the momentum written into the state it made
        convert(model)
    opt = CLASSES[name](orthoptim.param_groups(model), lr=0.02)
    w = model.lin.weight
    if reference:
        opt.state[w]["momentum"].copy_(buf)
    elif how == "replaced":  # an fp32 buffer for a parameter built in bf16
        convert(model)
        opt = CLASSES[name](orthoptim.param_groups(model), lr=0.02)
        w = model.lin.weight
        opt.state[w]["momentum"] = buf.clone()
    elif how == "other_converted":  # written in place, then a parameter it does not belong to converted
        opt.state[w]["momentum"].copy_(buf)
        convert(model)
    else:  # replaced, then the whole model converted
        opt.state[w]["momentum"] = buf.clone()
        convert(model)
    for t in range(2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(t)).to(p.dtype)
        opt.step()
    return model, opt


@pytest.mark.parametrize("how", ["replaced", "other_converted", "replaced_then_converted"])
@pytest.mark.parametrize("name", list(CLASSES))
def test_momentum_set_by_hand_before_the_first_step_is_kept_through_a_conversion(name, how):
    """The first step's remake of moved state (above) threw away a momentum the user had set, with no
    word: one of another dtype than the parameter, or any, once some other parameter was converted.
    What the user set is kept, converted to the parameter's dtype and device, as a load converts it."""
    (a, opt_a), (b, opt_b) = (_ported_run(name, how, reference=r) for r in (False, True))
    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    wa, wb = a.lin.weight, b.lin.weight
    assert opt_a.state[wa]["momentum"].dtype == wa.dtype
    assert torch.equal(opt_a.state[wa]["momentum"], opt_b.state[wb]["momentum"])


def test_a_momentum_set_by_hand_in_a_wrong_shape_is_refused_at_the_first_step_by_name():
    model = make_model()
    opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.02)
    opt.state[model.lin.weight]["momentum"] = torch.ones(3, 3)
    model.to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    held = {p: dict(st) for p, st in opt.state.items()}
    with raises_naming(ValueError, "lin.weight", "'momentum' has shape (3, 3)"):
        opt.step()
    assert all(opt.state[p][k] is v for p, st in held.items() for k, v in st.items())


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
def test_a_copy_keeps_which_state_was_set_by_hand(copy_with):
    """A copy made before the first step records its own tensors as made, except what the user set:
    that is kept through the copy's first-step remake as through the original's."""
    runs = []
    for copied in (False, True):
        model = make_model()
        opt = orthoptim.Dion2(orthoptim.param_groups(model), lr=0.02)
        buf = torch.randn(model.lin.weight.shape, generator=torch.Generator().manual_seed(5))
        opt.state[model.lin.weight]["momentum"].copy_(buf)
        if copied and copy_with == "deepcopy":
            model, opt = copy.deepcopy((model, opt))
        elif copied:
            model, opt = pickle.loads(pickle.dumps((model, opt)))
        model.to(torch.bfloat16)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        runs.append(opt.state[model.lin.weight]["momentum"])
    assert runs[1].abs().max() > 0.5
    assert torch.equal(*runs)


def test_a_first_step_refused_after_the_remake_leaves_the_state_counted_as_made():
    """A non-finite gradient refuses the first step after its remake; converted back, the next remake
    makes Dion's Q afresh (it copied the bf16-rounded Q, as if set by hand)."""
    model = make_model()
    opt = orthoptim.Dion(orthoptim.param_groups(model), lr=0.02)
    model.to(torch.bfloat16)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(orthoptim.NonFiniteGradientError):
        opt.step()
    model.to(torch.float32)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    fresh_model = make_model()
    fresh = orthoptim.Dion(orthoptim.param_groups(fresh_model), lr=0.02)
    for p in fresh_model.parameters():
        p.grad = torch.ones_like(p)
    fresh.step()
    assert torch.equal(opt.state[model.lin.weight]["Q"], fresh.state[fresh_model.lin.weight]["Q"])


def test_state_set_by_hand_that_a_load_would_refuse_is_refused_by_name():
    model = make_model()
    opt = orthoptim.Muon(orthoptim.param_groups(model), lr=0.02)
    opt.state[model.lin.weight]["momentum"] = torch.zeros(model.lin.weight.shape, dtype=torch.complex64)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with raises_naming(ValueError, "lin.weight", "'momentum'", "complex64", "floating-point"):
        opt.step()


def test_an_optimizer_can_be_built_under_inference_mode():
    model = make_model()
    with torch.inference_mode():
        opt = orthoptim.Dion3(orthoptim.param_groups(model), lr=0.02)
    model.to(torch.bfloat16)  # then made again as normal tensors
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


def test_a_model_converted_after_a_step_is_refused_with_the_fix():
    """After a step the state is the run's: it is not remade, and the step says how to bring it along."""
    model, opt = live_optimizer("dion3")
    model.to(torch.float64)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, dtype=torch.float64)
    before = {p: {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    with raises_naming(ValueError, "converted or moved", "opt.load_state_dict(opt.state_dict())"):
        opt.step()
    assert all(torch.equal(v, before[p][k]) for p, st in opt.state.items() for k, v in st.items())
    opt.load_state_dict(opt.state_dict())
    opt.step()


@pytest.mark.parametrize("how", ["deepcopy", "load_state_dict"])
def test_differentiable_groups_stay_refused_after_a_copy_or_a_load(how):
    """torch.optim's __setstate__ (deepcopy, pickle, load_state_dict) adds defaults['differentiable']
    = False; the refusal of differentiable=True then took the group, with a garbled warning."""
    model, opt = live_optimizer()
    if how == "deepcopy":
        model, opt = copy.deepcopy((model, opt))
    else:
        opt.load_state_dict(opt.state_dict())
    assert "differentiable" not in opt.defaults
    with raises_naming(ValueError, "differentiable=True", "no_grad"):
        opt.add_param_group(named_group(model, "out.weight", differentiable=True))
    assert len(opt.param_groups) == 3
    opt.add_param_group(named_group(model, "out.weight"))
    assert "differentiable" not in opt.param_groups[-1]


@pytest.mark.parametrize("name", ["muon", "normuon", "dion2", "dion3"])
def test_capturable_svd_is_refused_at_construction_and_at_step_time(name):
    """A capturable step flags a non-finite gradient instead of refusing it, and torch.linalg.svd raises
    on one half-way through the step (after the AdamW group had stepped, the momentum made NaN)."""
    with raises_naming(ValueError, "orthogonalizer='svd'", "capturable=True", "Newton-Schulz"):
        CLASSES[name]([make_model().lin.weight], orthogonalizer="svd", capturable=True)
    model, opt = live_optimizer(name, capturable=True)
    opt.param_groups[1]["orthogonalizer"] = "svd"
    set_grads(model, 2)
    before = snapshot(model, opt)
    with raises_naming(ValueError, "param group 1 (at step time)", "orthogonalizer='svd'"):
        opt.step()
    assert_unchanged(before, model, opt)
    CLASSES[name]([make_model().lin.weight], orthogonalizer="svd")  # fine without capturable


def test_warnings_point_at_the_callers_line():
    """From the constructor, step() (through torch.optim's hook wrapper, no_grad and compiler.disable)
    and load_state_dict, a warning names this file: filterwarnings(module=...) and the reported line
    are the user's. Fixed stacklevels pointed into base.py."""
    p = torch.nn.Parameter(torch.randn(4, 6))
    v = torch.nn.Parameter(torch.randn(6))
    with pytest.warns(UserWarning, match="did you mean 'epsilon'") as record:
        opt = orthoptim.Dion3([{"params": [p], "eps": 1e-6}, {"params": [v], "algorithm": "adamw"}],
                              nonfinite="skip")
    assert {w.filename for w in record} == {__file__}
    p.grad, v.grad = torch.full_like(p, float("nan")), torch.ones_like(v)
    with pytest.warns(UserWarning, match="update was skipped") as record:
        opt.step()
    assert {w.filename for w in record} == {__file__}
    opt.param_groups[1]["betas"] = (0.5, 0.999)
    opt.param_groups[0]["betas"] = (0.5, 0.999)
    p.grad = torch.ones_like(p)
    with pytest.warns(UserWarning, match="betas changed") as record:
        opt.step()
    assert {w.filename for w in record} == {__file__}
    saved = opt.state_dict()
    del saved["state"][1]["exp_avg_sq"]
    with pytest.warns(UserWarning, match="has no") as record:
        opt.load_state_dict(saved)
    assert {w.filename for w in record} == {__file__}


@pytest.mark.parametrize("name", list(CLASSES))
def test_torch_spellings_of_constructor_options_are_named(name):
    """torch.optim's eps= and momentum= are orthoptim's epsilon= and mu=; Python's own TypeError
    said only that the keyword was unexpected. Other unknown keywords keep Python's message."""
    p = torch.nn.Parameter(torch.randn(4, 6))
    with pytest.raises(TypeError, match=r"\['eps'\]; in orthoptim eps= is epsilon="):
        CLASSES[name]([p], eps=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        CLASSES[name]([p], bogus=1)
    assert "epsilon" in inspect.signature(CLASSES[name]).parameters  # the signature is the constructor's


def test_torch_muon_options_are_named_with_their_orthoptim_form():
    """torch.optim.Muon's ns_coefficients=, ns_steps= and adjust_lr_fn= (and its values), and an option
    of another rule (nesterov= to Dion3): each TypeError or ValueError says what to pass instead."""
    p = torch.nn.Parameter(torch.randn(4, 6))
    with raises_naming(TypeError, "ns_steps= is orthogonalizer=", "'newton_schulz'", "functools.partial"):
        orthoptim.Muon([p], ns_steps=5)
    with raises_naming(TypeError, "adjust_lr_fn= is adjust_lr=", "adjust_lr='original'", "'rms_norm'"):
        orthoptim.Muon([p], adjust_lr_fn="original")
    with raises_naming(TypeError, "eps= is epsilon=", "Newton-Schulz", "eps=...)"):
        orthoptim.Muon([p], eps=1e-7)
    with raises_naming(TypeError, "nesterov= is not read by Dion3", "muon, normuon"):
        orthoptim.Dion3([p], nesterov=True)
    with raises_naming(ValueError, "adjust_lr='match_rms_adamw'", "is adjust_lr='rms_norm' here"):
        orthoptim.Muon([p], adjust_lr="match_rms_adamw")


def test_adjust_lr_original_is_torch_muons_default_scale(monkeypatch):
    """√max(1, m/n): tall matrices as spectral_norm, wide ones at the plain lr (torch.optim.Muon's
    default, Keller Jordan's Muon); compared with torch's own step where this torch has it."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    torch.manual_seed(0)
    for shape in [(8, 32), (32, 8), (16, 16)]:
        ours = torch.nn.Parameter(torch.randn(shape))
        theirs = torch.nn.Parameter(ours.detach().clone())
        mine = orthoptim.Muon([ours], lr=0.02, mu=0.95, nesterov=True, weight_decay=0.1,
                              orthogonalizer="newton_schulz", adjust_lr="original")
        torch_muon = torch.optim.Muon([theirs], lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
        for t in range(3):
            g = torch.randn(shape, generator=torch.Generator().manual_seed(t))
            ours.grad, theirs.grad = g.clone(), g.clone()
            mine.step()
            torch_muon.step()
        # torch iterates in bf16; orthoptim in fp32 here: equal to bf16 round-off, a wide matrix's
        # update at √(m/n) = 0.5 of it would be off by half an update
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.1 * 0.02, msg=str(shape))


def test_a_torch_muon_momentum_ported_as_porting_md_says_continues_the_run(monkeypatch):
    """docs/porting.md: torch's momentum_buffer is (1 − μ)·orthoptim's momentum. Three steps of
    torch.optim.Muon, then its buffer set into a new orthoptim Muon: the next steps are torch's
    (and without the buffer they are not)."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    mu, shape = 0.95, (16, 24)
    theirs = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(9)))
    torch_muon = torch.optim.Muon([theirs], lr=0.02, momentum=mu, nesterov=True, weight_decay=0.1)

    def grad(t):
        return torch.randn(shape, generator=torch.Generator().manual_seed(t))
    for t in range(3):
        theirs.grad = grad(t)
        torch_muon.step()
    runs = []
    for ported in (True, False):
        ours = torch.nn.Parameter(theirs.detach().clone())
        mine = orthoptim.Muon([ours], lr=0.02, mu=mu, nesterov=True, weight_decay=0.1,
                              orthogonalizer="newton_schulz", adjust_lr="original")
        if ported:
            mine.state[ours]["momentum"] = torch_muon.state[theirs]["momentum_buffer"] / (1 - mu)
        runs.append((ours, mine))
    for t in range(3, 6):
        theirs.grad = grad(t)
        torch_muon.step()
        for ours, mine in runs:
            ours.grad = grad(t)
            mine.step()
    (ported, _), (not_ported, _) = runs
    torch.testing.assert_close(ported, theirs, rtol=0, atol=0.1 * 0.02)
    assert (not_ported - theirs).abs().max() > 0.5 * 0.02
