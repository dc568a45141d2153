"""Checkpointing and learning-rate schedules.

- ``state_dict`` → ``torch.save`` → ``torch.load`` → ``load_state_dict`` into a fresh optimizer over a
  fresh copy of the model: the following steps are bit-identical (``torch.equal``) to a run that was
  never interrupted, for every optimizer, with matrix groups next to AdamW / Lion groups.
- State exists for every parameter right after construction, with the keys its algorithm reads.
- Standard LR schedulers drive ``lr`` of every group, and the size of each update follows that ``lr``.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import re
import warnings

import pytest
import torch
from torch import nn

import orthoptim
from orthoptim.optim.base import COMMON_DEFAULTS as COMMON

CLASSES = {
    "dion3": orthoptim.Dion3,
    "dion2": orthoptim.Dion2,
    "dion": orthoptim.Dion,
    "muon": orthoptim.Muon,
    "normuon": orthoptim.NorMuon,
}
# Options that make each optimizer exercise its less common paths: Dion at a rank below full
# (Q sliced per block), Muon with Nesterov.
EXTRA = {"dion": {"rank_fraction": 0.5}, "muon": {"nesterov": True}}
STEPS_BEFORE, STEPS_AFTER = 3, 3


class TinyLM(nn.Module):
    """Embedding, fused QKV (per-head view), two same-shape matrices (one megabatch), a 3-D batch
    of matrices, a norm and an untied output head: every kind of group param_groups makes."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.gate = nn.Linear(d, d, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 8, d) / 4)
        self.fc = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)


OVERRIDES = {"qkv.weight": {"split_sizes": [16, 16, 16], "num_heads": 2}}


def make_model(dtype: torch.dtype = torch.float32) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(dtype)


def fresh_copy(model: nn.Module) -> nn.Module:
    """A new instance of the model class holding the same parameter values (not a deepcopy)."""
    other = TinyLM().to(next(model.parameters()).dtype)
    other.load_state_dict(model.state_dict())
    return other


def set_grads(model: nn.Module, step: int) -> None:
    """Deterministic gradients: a function of the step number and the parameter's position only."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def make_opt(name: str, model: nn.Module, scalar_algorithm: str = "adamw") -> orthoptim.OrthonormalOptimizer:
    groups = orthoptim.param_groups(model, scalar_algorithm=scalar_algorithm, overrides=OVERRIDES)
    return CLASSES[name](groups, lr=0.02, weight_decay=0.1, **EXTRA.get(name, {}))


def run(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for t in steps:
        set_grads(model, t)
        opt.step()


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def same_params(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def assert_same_state(opt_a: torch.optim.Optimizer, model_a: nn.Module,
                      opt_b: torch.optim.Optimizer, model_b: nn.Module) -> None:
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sorted(sa) == sorted(sb), name
        for key in sa:
            assert sa[key].dtype == sb[key].dtype, (name, key)
            assert torch.equal(sa[key], sb[key]), f"state {key!r} of {name} differs"


CASES = [(name, "adamw") for name in CLASSES] + [("dion3", "lion"), ("muon", "lion")]


@pytest.mark.parametrize(("name", "scalar_algorithm"), CASES)
def test_save_load_continues_bit_identically(name, scalar_algorithm):
    model_a = make_model()
    opt_a = make_opt(name, model_a, scalar_algorithm)
    run(model_a, opt_a, range(STEPS_BEFORE))

    saved = roundtrip(opt_a.state_dict())
    model_b = fresh_copy(model_a)
    opt_b = make_opt(name, model_b, scalar_algorithm)
    opt_b.load_state_dict(saved)
    assert_same_state(opt_a, model_a, opt_b, model_b)

    # Control: the same fresh optimizer without the checkpoint must diverge, or this test could not fail.
    model_c = fresh_copy(model_a)
    opt_c = make_opt(name, model_c, scalar_algorithm)

    run(model_a, opt_a, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    run(model_b, opt_b, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    run(model_c, opt_c, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    for (pname, pa), pb in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(pa, pb), f"{pname} differs after resuming from the checkpoint"
    assert_same_state(opt_a, model_a, opt_b, model_b)
    assert not same_params(model_a, model_c)


@pytest.mark.parametrize("capturable", [False, True])
def test_save_load_continues_bit_identically_under_a_float64_default_dtype(capturable):
    """AdamW's step counts are fp32 whatever the default dtype: made under torch.set_default_dtype(
    torch.float64) they were fp64, load_state_dict restored capturable ones as fp32, and the resumed
    run differed (1e-7)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model_a = make_model()
        opt_a = orthoptim.Muon(orthoptim.param_groups(model_a), lr=0.02, capturable=capturable)
        run(model_a, opt_a, range(STEPS_BEFORE))
        model_b = fresh_copy(model_a)
        opt_b = orthoptim.Muon(orthoptim.param_groups(model_b), lr=0.02, capturable=capturable)
        opt_b.load_state_dict(roundtrip(opt_a.state_dict()))
        run(model_a, opt_a, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
        run(model_b, opt_b, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    finally:
        torch.set_default_dtype(old)
    assert_same_state(opt_a, model_a, opt_b, model_b)
    assert same_params(model_a, model_b)
    assert {s["step"].dtype for s in opt_a.state.values() if "step" in s} == {torch.float32}


def test_save_load_with_scheduler_continues_bit_identically():
    """The scheduled lr lives in the param groups: it must come back with the checkpoint."""
    model_a = make_model()
    opt_a = make_opt("dion3", model_a)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.5)
    for t in range(STEPS_BEFORE):
        set_grads(model_a, t)
        opt_a.step()
        sched_a.step()
    saved = roundtrip({"opt": opt_a.state_dict(), "sched": sched_a.state_dict()})

    model_b = fresh_copy(model_a)
    opt_b = make_opt("dion3", model_b)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, step_size=2, gamma=0.5)
    opt_b.load_state_dict(saved["opt"])
    sched_b.load_state_dict(saved["sched"])
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]
    assert opt_a.param_groups[0]["lr"] == 0.02 * 0.5

    for model, opt, sched in ((model_a, opt_a, sched_a), (model_b, opt_b, sched_b)):
        for t in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            set_grads(model, t)
            opt.step()
            sched.step()
    assert same_params(model_a, model_b)
    assert_same_state(opt_a, model_a, opt_b, model_b)
    assert [g["lr"] for g in opt_b.param_groups] == [g["lr"] for g in opt_a.param_groups]


@pytest.mark.parametrize("name", ["normuon", "dion3"])
def test_save_load_bf16_parameters_keeps_fp32_variance(name):
    model_a = make_model(torch.bfloat16)
    opt_a = make_opt(name, model_a)
    run(model_a, opt_a, range(STEPS_BEFORE))
    model_b = fresh_copy(model_a)
    opt_b = make_opt(name, model_b)
    opt_b.load_state_dict(roundtrip(opt_a.state_dict()))
    assert_same_state(opt_a, model_a, opt_b, model_b)


def test_save_load_bf16_parameters_without_variance_state():
    """The same bf16 round trip for rules whose state is all in the parameter dtype (passes today)."""
    for name in ("muon", "dion2", "dion"):
        model_a = make_model(torch.bfloat16)
        opt_a = make_opt(name, model_a)
        run(model_a, opt_a, range(STEPS_BEFORE))
        model_b = fresh_copy(model_a)
        opt_b = make_opt(name, model_b)
        opt_b.load_state_dict(roundtrip(opt_a.state_dict()))
        run(model_a, opt_a, range(STEPS_BEFORE, STEPS_BEFORE + 2))
        run(model_b, opt_b, range(STEPS_BEFORE, STEPS_BEFORE + 2))
        assert same_params(model_a, model_b), name


def test_load_pre_hooks_are_run_before_the_checks_and_the_variance_copy():
    """torch.optim's way to adapt a state dict is a load pre-hook; the checks and the fp32 variance
    copy read the dict as given, before torch.optim ran the hooks: a hook that reorders the state
    gave each matrix the other's variance, one that completes a missing key was refused."""
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.randn(8, 12))
    saved_opt = orthoptim.Dion3([a, b], lr=0.1)
    a.grad, b.grad = torch.randn(8, 12), 10 * torch.randn(8, 12)
    saved_opt.step()
    saved = saved_opt.state_dict()
    opt = orthoptim.Dion3([b, a], lr=0.1)  # the parameters in the other order

    def swap(optimizer, state_dict):
        group = {**state_dict["param_groups"][0]}
        del group["algorithm"]  # as a state dict of another program might lack it; the hook completes it
        return {"state": {0: state_dict["state"][1], 1: state_dict["state"][0]}, "param_groups": [group]}

    def complete(optimizer, state_dict):
        state_dict["param_groups"][0]["algorithm"] = "dion3"

    seen = []
    opt.register_load_state_dict_pre_hook(swap)
    opt.register_load_state_dict_pre_hook(complete)
    opt.register_load_state_dict_post_hook(lambda o: seen.append(o.state[a]["variance"].clone()))
    opt.load_state_dict(saved)
    for p in (a, b):
        for key in ("momentum", "variance"):
            assert torch.equal(opt.state[p][key], saved_opt.state[p][key]), key
    assert len(seen) == 1 and torch.equal(seen[0], saved_opt.state[a]["variance"])
    opt.load_state_dict(saved)  # the hooks are still registered
    assert len(seen) == 2


# ----------------------------------------------------------------------------- eager state
def expected_state(algorithm: str, p: torch.Tensor, opts: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key → (shape, dtype) of the state each algorithm reads, written from DESIGN.md §1."""
    like = (tuple(p.shape), p.dtype)
    if algorithm == "adamw":
        return {"step": ((), torch.float32), "exp_avg": like, "exp_avg_sq": like}
    if algorithm == "lion":
        return {"exp_avg": like}
    rows, cols = (p.shape[0], math.prod(p.shape[1:])) if p.ndim == 2 else tuple(p.shape[1:])
    batch = p.shape[0] if p.ndim == 3 else 1
    out = {"momentum": like}
    if algorithm in ("normuon", "dion3"):
        out["variance"] = ((batch, rows), torch.float32)  # one second moment per row (neuron)
    if algorithm == "dion":
        blocks = opts.get("num_heads") or 1
        blocks *= len(opts.get("split_sizes") or [rows])
        block_rows = rows // blocks
        rank = math.ceil(opts["rank_fraction"] * min(block_rows, cols))
        out["Q"] = ((batch * blocks, cols, rank), p.dtype)  # right factor per matrix
    return out


@pytest.mark.parametrize(("name", "scalar_algorithm"), CASES)
def test_state_exists_for_every_parameter_before_any_step(name, scalar_algorithm):
    model = make_model()
    opt = make_opt(name, model, scalar_algorithm)
    names = dict((id(p), n) for n, p in model.named_parameters())
    assert len(opt.state) == len(list(model.parameters()))
    seen_algorithms = set()
    for group in opt.param_groups:
        algorithm = group["algorithm"]
        seen_algorithms.add(algorithm)
        for p in group["params"]:
            expected = expected_state(algorithm, p, group)
            state = opt.state[p]
            got = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
            assert got == expected, names[id(p)]
            for key, value in state.items():
                if key == "Q":
                    assert torch.isfinite(value).all() and value.abs().sum() > 0  # a random start, not zeros
                else:
                    assert not value.any(), f"{key} of {names[id(p)]} should start at zero"
    assert seen_algorithms == {name, scalar_algorithm}
    # The saved checkpoint already holds every parameter's state (distributed checkpoints need this).
    assert len(opt.state_dict()["state"]) == len(list(model.parameters()))


def test_dion_initial_right_factor_is_deterministic():
    """Two optimizers built alike start from the same random Q (every rank and run starts alike)."""
    a = make_opt("dion", make_model())
    b = make_opt("dion", make_model())
    qa = [s["Q"] for s in a.state.values() if "Q" in s]
    qb = [s["Q"] for s in b.state.values() if "Q" in s]
    assert qa and all(torch.equal(x, y) for x, y in zip(qa, qb, strict=True))



def test_dion_initial_right_factor_is_seeded_by_the_parameters_position():
    """Parameter k's Q starts from randn seeded DION_Q_SEED + k, columns normalized: same-shape matrices
    start from different Q (one seed for all would start every one from the same directions), and
    any process rebuilds each one's Q from its position alone."""
    from orthoptim.optim.state import DION_Q_SEED
    from orthoptim.orthogonalize import normalize_columns

    params = [nn.Parameter(torch.randn(8, 6)) for _ in range(3)]
    opt = orthoptim.Dion(params, lr=0.01, rank_fraction=0.5)
    qs = [opt.state[p]["Q"] for p in params]
    assert not torch.equal(qs[0], qs[1]) and not torch.equal(qs[1], qs[2])
    eps = opt.param_groups[0]["epsilon"]
    for k, q in enumerate(qs):
        gen = torch.Generator().manual_seed(DION_Q_SEED + k)
        assert torch.equal(q, normalize_columns(torch.randn(q.shape, generator=gen), eps)), f"Q of parameter {k}"


# ----------------------------------------------------------------------------- LR schedulers
SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[0.04, 0.02], total_steps=8, cycle_momentum=False),
}
LRS = (0.03, 0.01)  # matrix group, Lion group


def scheduled_model():
    torch.manual_seed(3)
    return nn.Linear(12, 8)


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_scheduler_drives_every_group_and_update_size_follows(kind):
    """Muon with mu=0, no weight decay, no lr scaling and an exact polar factor, fed the same gradient
    every step, moves the weight by exactly lr_t·orth(G) (Frobenius norm lr_t·√min(m, n)); Lion with a
    constant gradient moves every bias entry by exactly lr_t. The expected lr_t comes from the same
    scheduler driving a plain torch SGD with the same groups."""
    model = scheduled_model()
    groups = [
        {"params": [model.weight], "param_names": ["weight"], "lr": LRS[0]},
        {"params": [model.bias], "param_names": ["bias"], "algorithm": "lion", "lr": LRS[1]},
    ]
    opt = orthoptim.Muon(groups, mu=0.0, weight_decay=0.0, adjust_lr=None, orthogonalizer="svd")
    sched = SCHEDULERS[kind](opt)
    dummy = [nn.Parameter(torch.zeros(1)), nn.Parameter(torch.zeros(1))]
    ref_opt = torch.optim.SGD([{"params": [dummy[0]], "lr": LRS[0]}, {"params": [dummy[1]], "lr": LRS[1]}])
    ref_sched = SCHEDULERS[kind](ref_opt)

    gen = torch.Generator().manual_seed(4)
    gw, gb = torch.randn(8, 12, generator=gen), torch.randn(8, generator=gen)
    polar_norm = math.sqrt(8)
    seen = []
    for _ in range(7):
        expected = [g["lr"] for g in ref_opt.param_groups]
        assert [g["lr"] for g in opt.param_groups] == expected
        w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
        model.weight.grad, model.bias.grad = gw.clone(), gb.clone()
        opt.step()
        dw, db = model.weight.detach() - w0, model.bias.detach() - b0
        if expected[0] == 0.0:
            assert torch.equal(model.weight, w0)
        else:
            assert math.isclose(float(dw.norm()), expected[0] * polar_norm, rel_tol=1e-4)
        if expected[1] == 0.0:
            assert torch.equal(model.bias, b0)
        else:
            torch.testing.assert_close(db, -expected[1] * torch.sign(gb), rtol=0, atol=2e-7 + 1e-4 * expected[1])
        seen.append(expected)
        sched.step()
        ref_opt.step()  # no gradients: changes nothing, keeps the scheduler's call-order check quiet
        ref_sched.step()
    # The schedule really changed lr in both groups (a frozen lr would pass the checks above).
    assert len({lr[0] for lr in seen}) >= 3 and len({lr[1] for lr in seen}) >= 3
    if kind == "cosine":
        assert [0.0, 0.0] in seen  # T_max=4: lr reaches exactly 0, and the weights did not move


def test_halving_lr_halves_the_muon_step():
    """Same gradients, same state: an lr half as large gives a step half as large (weight_decay=0)."""
    deltas = []
    for lr in (0.02, 0.01):
        model = scheduled_model()
        opt = orthoptim.Muon([model.weight], lr=lr, weight_decay=0.0)
        for t in range(3):
            before = model.weight.detach().clone()
            gen = torch.Generator().manual_seed(10 + t)
            model.weight.grad = torch.randn(8, 12, generator=gen)
            opt.step()
        deltas.append(model.weight.detach() - before)
    torch.testing.assert_close(deltas[1], deltas[0] / 2, rtol=1e-3, atol=1e-6)
    assert deltas[0].abs().max() > 1e-3


@pytest.mark.parametrize("name", list(CLASSES))
def test_zero_lr_leaves_every_parameter_unchanged(name):
    """lr scheduled to 0: no parameter moves, including through weight decay (X·(1 − 0·wd) = X),
    in the matrix groups and the AdamW group alike; the state still advances."""
    model = make_model()
    opt = make_opt(name, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    run(model, opt, range(2))
    sched.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert any(s["momentum"].any() for s in opt.state.values() if "momentum" in s)


# ----------------------------------------------------------------------------- refused checkpoints
def _state_copy(opt: torch.optim.Optimizer) -> dict:
    return {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}


def _assert_state_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert sorted(a[k]) == sorted(b[k]) and all(torch.equal(a[k][kk], b[k][kk]) for kk in a[k])


def _trained(cls, shapes, **options):
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    opt = cls([{"params": params, "param_names": [f"w{i}" for i in range(len(params))], **options}])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt, params


@pytest.mark.parametrize(("options", "saved_shape", "shape", "key"), [
    ({"algorithm": "adamw"}, (8,), (4096,), "exp_avg"),  # fused AdamW would run on the short buffers
    ({}, (8, 16), (4, 32), "momentum"),  # same element count: the step would use the wrong layout
    ({"algorithm": "dion", "rank_fraction": 0.5}, (4, 32), (32, 4), "momentum"),
], ids=["adamw", "dion3", "dion"])
def test_state_of_other_shapes_is_refused_naming_the_parameter(options, saved_shape, shape, key):
    source, _ = _trained(orthoptim.Dion3, [saved_shape], **options)
    target, _ = _trained(orthoptim.Dion3, [shape], **options)
    before = _state_copy(target)
    with pytest.raises(ValueError, match=rf"parameter w0: the loaded state '{key}' has shape"):
        target.load_state_dict(source.state_dict())
    _assert_state_equal(before, _state_copy(target))


@pytest.mark.parametrize(("options", "key", "value", "what"), [
    ({}, "variance", [[0.0] * 16] * 8, "a list"),  # made the load half-happen: options in, stacks broken
    ({}, "momentum", None, "a NoneType"),
    ({"algorithm": "dion2"}, "momentum", torch.zeros(8, 16, dtype=torch.int64), "a torch.int64 tensor"),
    ({"algorithm": "adamw"}, "exp_avg", None, "a NoneType"),
    ({"algorithm": "adamw"}, "step", "3", "a str"),
    ({"algorithm": "adamw"}, "step", torch.tensor(True), "a torch.bool tensor"),
    ({"algorithm": "adamw"}, "step", torch.tensor(3.0, device="meta"), "a tensor on meta"),
], ids=["variance-list", "momentum-none", "momentum-int", "exp_avg-none", "step-str", "step-bool", "step-meta"])
def test_state_entries_a_step_cannot_use_are_refused_before_anything_loads(options, key, value, what):
    """torch.optim loads any value; a step then failed half-way (after the AdamW group had stepped)."""
    shapes = [(8, 16), (8, 16)] if options.get("algorithm") != "adamw" else [(8,), (8,)]
    source, _ = _trained(orthoptim.Dion3, shapes, **options)
    target, params = _trained(orthoptim.Dion3, shapes, lr=0.5, **options)
    saved = source.state_dict()
    saved["param_groups"][0]["lr"] = 0.1
    saved["state"][1][key] = value
    before = _state_copy(target)
    views = [target.state[p].get("momentum") for p in params]
    with pytest.raises(ValueError, match=rf"parameter w1: the loaded state '{key}' is {re.escape(what)}"):
        target.load_state_dict(saved)
    _assert_state_equal(before, _state_copy(target))
    assert target.param_groups[0]["lr"] == 0.5  # the refused dict's options are not taken either
    assert all(target.state[p].get("momentum") is v for p, v in zip(params, views))


@pytest.mark.parametrize(("options", "key", "value"), [
    ({"algorithm": "lion"}, "step", "two"),
    ({"algorithm": "lion"}, "step", torch.tensor([1.0, 2.0])),
    ({"algorithm": "adamw"}, "variance", "oops"),
    ({}, "step", "two"),
], ids=["lion-step-str", "lion-step-[2]", "adamw-variance-str", "dion3-step-str"])
def test_a_key_the_rule_does_not_keep_loads_as_given_without_half_loading(options, key, value):
    """A key outside what the group's rule keeps is loaded as torch.optim loads it, untouched: the
    conversion of AdamW's count and of Dion3's variance applied to every entry's, and failed on such
    a value after the state and options had been replaced (a refused load, half done)."""
    shapes = [(8, 16), (8, 16)] if not options else [(8,), (8,)]
    source, _ = _trained(orthoptim.Dion3, shapes, **options)
    target, params = _trained(orthoptim.Dion3, shapes, lr=0.5, **options)
    saved = source.state_dict()
    saved["param_groups"][0]["lr"] = 0.1
    saved["state"][1][key] = value
    target.load_state_dict(saved)
    assert target.param_groups[0]["lr"] == 0.1
    assert key in target.state[params[1]]  # as torch.optim left it (which makes a str into another one)
    for p in params:
        p.grad = torch.randn_like(p)
    target.step()
    assert all(torch.isfinite(p).all() for p in params)


def test_a_rule_option_warning_raised_as_an_error_leaves_the_optimizer_as_it_was():
    """Under warnings-as-errors the warning that a loaded group changes a rule option aborts the load:
    it is given before anything is loaded (it came after the state had been replaced)."""
    source, _ = _trained(orthoptim.Dion3, [(8, 16), (8, 16)], fraction=0.5)
    target, params = _trained(orthoptim.Dion3, [(8, 16), (8, 16)], lr=0.5)
    before = _state_copy(target)
    views = [target.state[p]["momentum"] for p in params]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match=r"sets fraction=0\.5"):
            target.load_state_dict(source.state_dict())
    _assert_state_equal(before, _state_copy(target))
    assert target.param_groups[0]["fraction"] == 0.25 and target.param_groups[0]["lr"] == 0.5
    assert all(target.state[p]["momentum"] is v for p, v in zip(params, views))


@pytest.mark.parametrize("step", [3, 3.0, torch.tensor(3), torch.tensor([3.0])], ids=["int", "float", "int64", "[1]"])
def test_a_step_count_saved_as_another_number_loads_as_the_fp32_count(step):
    """AdamW's count as another library or version may write it: the 0-dim fp32 tensor the step keeps
    (an int64 tensor stopped the step half-way; a Python number raised inside it)."""
    source, _ = _trained(orthoptim.Dion3, [(8,), (8,)], algorithm="adamw")
    source.step()
    source.step()
    saved = source.state_dict()
    assert float(saved["state"][0]["step"]) == 3.0
    targets = []
    for count in (saved["state"][0]["step"], step):
        torch.manual_seed(1)
        target, params = _trained(orthoptim.Dion3, [(8,), (8,)], algorithm="adamw")
        loading = copy.deepcopy(saved)  # an in-memory load shares tensors with the dict, as torch.optim's does
        loading["state"][0]["step"] = count
        target.load_state_dict(loading)
        loaded = target.state[params[0]]["step"]
        assert (loaded.dtype, loaded.shape, loaded.device.type, float(loaded)) == (torch.float32, (), "cpu", 3.0)
        target.step()  # the gradients _trained left
        targets.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*targets))


def test_dion_factor_of_another_rank_is_refused_at_load():
    source, _ = _trained(orthoptim.Dion, [(8, 16)], rank_fraction=0.5)
    target, _ = _trained(orthoptim.Dion, [(8, 16)], rank_fraction=0.25)
    saved = source.state_dict()
    saved["param_groups"][0]["rank_fraction"] = 0.25  # the group says one rank, the saved Q another
    with pytest.raises(ValueError, match=r"parameter w0: the loaded state 'Q' has shape \(1, 16, 4\)"):
        target.load_state_dict(saved)


def test_a_torch_optimizer_state_dict_is_refused():
    p = nn.Parameter(torch.randn(8))
    torch_opt = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    torch_opt.step()
    target, _ = _trained(orthoptim.Dion3, [(8,)], algorithm="adamw")
    with pytest.raises(ValueError, match=r"no 'algorithm' key.*Dion3\.state_dict\(\)"):
        target.load_state_dict(torch_opt.state_dict())


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("fraction", 3.0, "fraction=3.0 in param group 0 of the loaded state dict"),
    ("nonfinite", "whatever", "nonfinite='whatever' in param group 0 of the loaded state dict"),
    ("num_heads", 3, "num_heads=3 must divide its 8 rows"),
])
def test_bad_hyperparameters_in_a_checkpoint_are_refused_before_loading(key, value, fragment):
    source, _ = _trained(orthoptim.Dion3, [(8, 16)])
    target, _ = _trained(orthoptim.Dion3, [(8, 16)])
    saved = source.state_dict()
    saved["param_groups"][0][key] = value
    before = _state_copy(target)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        target.load_state_dict(saved)
    _assert_state_equal(before, _state_copy(target))
    assert target.param_groups[0][key] == COMMON[key]


def test_keys_missing_from_an_older_checkpoint_keep_their_values():
    source, _ = _trained(orthoptim.Dion3, [(8, 16)], selection_scope="local")
    target, params = _trained(orthoptim.Dion3, [(8, 16)])
    saved = source.state_dict()
    del saved["param_groups"][0]["selection_scope"], saved["param_groups"][0]["qr_method"]
    target.load_state_dict(saved)
    assert target.param_groups[0]["selection_scope"] == "local"
    assert target.param_groups[0]["qr_method"] == "cholesky_qr"
    params[0].grad = torch.randn_like(params[0])
    target.step()


def _user_polar(batch: torch.Tensor) -> torch.Tensor:
    """A user's orthogonalizer: the exact polar factor."""
    return orthoptim.svd_polar(batch)


@pytest.mark.parametrize("orthogonalizer", [orthoptim.svd_polar, _user_polar,
                                            functools.partial(orthoptim.newton_schulz, coefficients="keller_jordan")])
def test_a_callable_orthogonalizer_is_saved_by_name_and_kept_at_load(orthogonalizer):
    """A callable in param_groups made torch.load(weights_only=True), torch's default, refuse the file."""
    model = make_model()
    groups = orthoptim.param_groups(model)
    opt = orthoptim.Muon(groups, lr=0.02, orthogonalizer=orthogonalizer)
    run(model, opt, range(2))
    saved = roundtrip(opt.state_dict())
    assert saved["param_groups"][0]["orthogonalizer"].startswith("callable:")
    model2 = fresh_copy(model)
    opt2 = orthoptim.Muon(orthoptim.param_groups(model2), lr=0.02, orthogonalizer=orthogonalizer)
    opt2.load_state_dict(saved)
    kept = opt2.param_groups[0]["orthogonalizer"]  # torch.optim deep-copies the loaded groups (a partial too)
    assert kept is orthogonalizer or (kept.func is orthogonalizer.func and kept.keywords == orthogonalizer.keywords)
    run(model, opt, range(2, 4))
    run(model2, opt2, range(2, 4))
    assert same_params(model, model2)


def test_a_saved_callable_loaded_where_the_group_has_another_orthogonalizer_warns():
    model = make_model()
    opt = orthoptim.Muon(orthoptim.param_groups(model), lr=0.02, orthogonalizer=_user_polar)
    run(model, opt, range(1))
    opt2 = orthoptim.Muon(orthoptim.param_groups(fresh_copy(model)), lr=0.02, orthogonalizer="newton_schulz")
    with pytest.warns(UserWarning, match=r"param group 0 .*_user_polar .*orthogonalizer='newton_schulz'") as caught:
        opt2.load_state_dict(roundtrip(opt.state_dict()))
    assert opt2.param_groups[0]["orthogonalizer"] == "newton_schulz"
    assert {w.filename for w in caught} == {__file__}  # the warning points at the caller's line


def test_loading_another_algorithms_state_dict_warns_that_it_now_runs():
    model = nn.Linear(8, 8, bias=False)
    model.weight.grad = torch.randn(8, 8)
    saved = orthoptim.Dion3(model.parameters(), lr=0.02)
    saved.step()
    target = orthoptim.Muon(model.parameters(), lr=0.02)
    changed = r"group 0: the state dict sets algorithm='dion3'.* had algorithm='muon'"
    with pytest.warns(UserWarning, match=changed) as caught:
        target.load_state_dict(saved.state_dict())
    assert target.param_groups[0]["algorithm"] == "dion3"
    assert {w.filename for w in caught} == {__file__}  # the warning points at the caller's line
    same = orthoptim.Dion3(model.parameters(), lr=0.01)  # another lr: schedules own it, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved.state_dict())
    # A fraction the new optimizer was built with is replaced by the saved one: said, as the algorithm is.
    wider = orthoptim.Dion3(model.parameters(), lr=0.02, fraction=0.5)
    with pytest.warns(UserWarning, match=r"sets fraction=0.25 .* had fraction=0.5.*group\['fraction'\] back"):
        wider.load_state_dict(saved.state_dict())
    assert wider.param_groups[0]["fraction"] == 0.25


@pytest.mark.parametrize("cls", [orthoptim.Dion3, orthoptim.NorMuon, orthoptim.Dion])
def test_changing_transpose_under_per_row_state_is_refused_also_for_square_matrices(cls):
    """A square matrix's variance (or Q) has the same shape either way, but belongs to the other axis."""
    w = nn.Parameter(torch.randn(16, 16))
    opt = cls([w], lr=0.02)
    w.grad = torch.randn(16, 16)
    opt.step()
    opt.param_groups[0]["transpose"] = True
    before = w.detach().clone()
    with pytest.raises(ValueError, match=r"was made with transpose=False and the group now has transpose=True"):
        opt.step()
    assert torch.equal(w.detach(), before)
    opt.param_groups[0]["transpose"] = False
    opt.step()  # as it was: steps again


@pytest.mark.parametrize("name", ["normuon", "dion3", "dion"])
def test_transposed_per_row_state_loads_and_continues_bit_identically(name):
    """Experts stored [E, in, out] with transpose=True: the loaded variance (or Q) was made under the
    group's transpose=True. Recorded as made under transpose=False, the next step refuses it as state
    of the other axis."""
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(2, 12, 8, generator=gen)
    grads = [torch.randn(2, 12, 8, generator=gen) for _ in range(3)]

    def make(p):
        return orthoptim.Dion3([{"params": [p], "algorithm": name, "transpose": True}], lr=0.02)

    whole, resumed = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    reference, first = make(whole), make(resumed)
    for g in grads:
        whole.grad = g.clone()
        reference.step()
    for g in grads[:2]:
        resumed.grad = g.clone()
        first.step()
    second = make(resumed)
    second.load_state_dict(roundtrip(first.state_dict()))
    resumed.grad = grads[2].clone()
    second.step()
    assert torch.equal(resumed.detach(), whole.detach())


def test_a_state_dict_from_before_the_transpose_option_loads_as_saved():
    """Saved groups without 'transpose' were made under transpose=False: the group takes it (with a
    warning where the loading group was built with transpose=True, as param_groups now does for
    GPT-2's Conv1D), and the run continues as the uninterrupted one."""
    torch.manual_seed(0)
    init = torch.randn(16, 24)
    grads = [torch.randn(16, 24) for _ in range(4)]
    whole = nn.Parameter(init.clone())
    reference = orthoptim.Dion3([whole], lr=0.02)
    resumed = nn.Parameter(init.clone())
    first = orthoptim.Dion3([resumed], lr=0.02)
    for step, g in enumerate(grads):
        for p, opt in ((whole, reference), (resumed, first)):
            if opt is first and step >= 2:
                continue
            p.grad = g.clone()
            opt.step()
    saved = first.state_dict()
    for group in saved["param_groups"]:
        del group["transpose"]  # as an earlier version wrote it
    second = orthoptim.Dion3([{"params": [resumed], "transpose": True}], lr=0.02)
    with pytest.warns(UserWarning, match=r"saved before the 'transpose' option existed.*takes transpose=False"):
        second.load_state_dict(saved)
    assert second.param_groups[0]["transpose"] is False
    for g in grads[2:]:
        resumed.grad = g.clone()
        second.step()
    torch.testing.assert_close(resumed.detach(), whole.detach(), rtol=0, atol=0)


def test_an_optimizer_pickled_before_the_later_attributes_still_steps():
    w = nn.Parameter(torch.randn(8, 12))
    opt = orthoptim.Dion3([w], lr=0.02)
    state = opt.__getstate__()
    for name in ("_betas_seen", "_betas_warned", "_state_transposed"):
        del state[name]
    for group in state["param_groups"]:
        del group["transpose"]
    del state["defaults"]["transpose"]
    old = orthoptim.Dion3.__new__(orthoptim.Dion3)
    old.__setstate__(state)
    w.grad = torch.randn(8, 12)
    old.step()
    assert old.param_groups[0]["transpose"] is False


def test_loading_the_same_names_in_another_order_warns_and_keeps_this_optimizers_names():
    """Same-shape matrices listed in reverse: position would give each another's momentum, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = orthoptim.Dion3(orthoptim.param_groups(model))
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    groups = orthoptim.param_groups(model)
    for g in groups:
        g["params"].reverse()
        g["param_names"].reverse()
    reordered = orthoptim.Dion3(groups)
    names = [list(g["param_names"]) for g in reordered.param_groups]
    expected = r"another order: parameter #0 is '0.weight' there and '4.weight' here"
    with pytest.warns(UserWarning, match=expected) as caught:
        reordered.load_state_dict(opt.state_dict())
    assert {w.filename for w in caught} == {__file__}
    assert [g["param_names"] for g in reordered.param_groups] == names  # they name this optimizer's params
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same order: no warning
        orthoptim.Dion3(orthoptim.param_groups(model)).load_state_dict(opt.state_dict())


def test_a_distributed_checkpoint_load_into_reordered_groups_maps_by_name_without_a_warning():
    """torch.distributed.checkpoint's set_optimizer_state_dict maps by name itself and passes the saved
    param_names through: the reordered-names warning must not fire there."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    opt = orthoptim.Dion3(orthoptim.param_groups(model))
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt)
    groups = orthoptim.param_groups(model)
    for g in groups:
        g["params"].reverse()
        g["param_names"].reverse()
    reordered = orthoptim.Dion3(groups)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        set_optimizer_state_dict(model, reordered, saved)
    for p in model.parameters():
        if "momentum" in opt.state[p]:
            assert torch.equal(reordered.state[p]["momentum"], opt.state[p]["momentum"])


@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("cleared", [False, True], ids=["target with state", "target cleared"])
def test_loading_makes_no_state_entry_for_a_parameter_without_saved_state(capturable, cleared):
    """torch.optim's state is a defaultdict: looking up a parameter that has no saved state (no gradient
    yet after opt.state.clear()) added an empty entry, and the loaded copy's state dict had one more."""
    def build():
        params = [nn.Parameter(torch.randn(s)) for s in [(8, 16), (5, 7)]]
        return orthoptim.Dion3(params, capturable=capturable), params
    source, params = build()
    params[0].grad = torch.randn_like(params[0])
    source.step()
    source.state.clear()
    source.step()
    saved = source.state_dict()
    assert len(saved["state"]) == 1
    target, _ = build()
    if cleared:
        target.state.clear()
    target.load_state_dict(saved)
    assert len(target.state) == 1 and len(target.state_dict()["state"]) == 1


def test_a_state_of_another_rule_is_refused_and_a_partial_one_warns():
    """torch.optim loads any keys: an AdamW vector's state swapped with a matrix's loaded silently and
    the step started both afresh (keeping the foreign keys); a state missing a key loses it silently."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(8))]

    def build():
        return orthoptim.Dion3([{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}], lr=0.02)
    source = build()
    for p in params:
        p.grad = torch.randn_like(p)
    source.step()
    target = build()
    before = _state_copy(target)
    swapped = copy.deepcopy(source.state_dict())
    swapped["state"][0], swapped["state"][1] = swapped["state"][1], swapped["state"][0]
    refused = (r"param_groups\[0\].params\[0\] \(#0\): the loaded state has keys "
               r"\['exp_avg', 'exp_avg_sq', 'step'\] but dion3 keeps \['momentum', 'variance'\]")
    with pytest.raises(ValueError, match=refused):
        target.load_state_dict(swapped)
    _assert_state_equal(before, _state_copy(target))
    partial = copy.deepcopy(source.state_dict())
    del partial["state"][1]["step"]
    lost = r"#1\): the loaded state has no \['step'\]; the next step makes it afresh"
    with pytest.warns(UserWarning, match=lost) as caught:
        target.load_state_dict(partial)
    assert {w.filename for w in caught} == {__file__}  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(source.state_dict())  # complete: no warning


def test_a_saved_group_without_params_is_refused_by_name():
    source, _ = _trained(orthoptim.Dion3, [(8, 16)])
    saved = source.state_dict()
    del saved["param_groups"][0]["params"]
    with pytest.raises(ValueError, match=r"param group 0 of the loaded state dict has no 'params' list"):
        source.load_state_dict(saved)


def test_numpy_hyperparameters_are_kept_as_python_numbers():
    """Options from a config or a sweep often arrive as numpy scalars; kept as they were, the state dict
    held them and torch.load(weights_only=True) refused it."""
    np = pytest.importorskip("numpy")
    w, b = torch.nn.Parameter(torch.randn(6, 8)), torch.nn.Parameter(torch.randn(8))
    opt = orthoptim.Dion3([{"params": [w], "fraction": np.float64(0.5)},
                           {"params": [b], "algorithm": "adamw", "betas": (np.float32(0.9), np.float64(0.95))}],
                          lr=np.float64(0.02), weight_decay=np.float32(0.1))
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["param_groups"][0]["lr"] == 0.02 and type(loaded["param_groups"][0]["lr"]) is float
    assert type(loaded["param_groups"][0]["fraction"]) is float
    assert all(type(beta) is float for beta in loaded["param_groups"][1]["betas"])
