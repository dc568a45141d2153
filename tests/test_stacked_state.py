"""Dion2/Dion3 state stacked per megabatch (``orthoptim.optim.stacked_state``): the batched row selection
gives the per-matrix ops' numbers bit for bit, and the stacks survive what an optimizer goes through."""

from __future__ import annotations

import collections
import contextlib
import copy
import pickle

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
            mp.setattr(base.OrthonormalOptimizer, "_selection_stacks", lambda *_: None)
        for t in range(steps):
            _grads(params, t, skip=(1,) if t == skip_at else ())
            opt.step()
    return params, opt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["dion3", "dion2"])
def test_batched_selection_gives_the_per_matrix_numbers(monkeypatch, name, dtype):
    """Every step, including one where a matrix of the stack has no gradient (its batch is then not
    one run of the stack, and the per-matrix ops run)."""
    calls = _spy_on_batched_norms(monkeypatch)
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


def _spy_on_batched_norms(monkeypatch) -> list[int]:
    calls = []
    original = selection.accumulate_and_l1_norms_stacked_
    monkeypatch.setattr(selection, "accumulate_and_l1_norms_stacked_", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize(("case", "batched"), [
    ("transposed", False),  # [in, out] weights: each matrix a strided view; l1_norms sums a contiguous copy
    ("3-D above the CPU limit", False),  # 2 × 400×300: l1_norms sums such matrices block by block
    ("one tall matrix above the CPU limit", False),
    ("3-D of small matrices", True),  # its matrices are equally spaced views of one momentum already
])
def test_batched_norms_only_where_they_reduce_as_the_per_matrix_ones(monkeypatch, case, batched):
    """Norms summed in another order differ in the last bits, and at a near-tie another row is picked."""
    gen = torch.Generator().manual_seed(3)
    shapes, group = {
        "transposed": ([(24, 16)] * 3, {"transpose": True}),
        "3-D above the CPU limit": ([(2, 400, 300)], {}),
        "one tall matrix above the CPU limit": ([(400, 300)], {}),
        "3-D of small matrices": ([(4, 16, 24)], {}),
    }[case]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = orthoptim.Dion2([{"params": params, **group}], lr=0.02, fraction=0.25)
    calls = _spy_on_batched_norms(monkeypatch)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    assert bool(calls) == batched


def test_a_near_tie_picks_the_per_matrix_slice():
    """Two columns of a 400×300 matrix (above the CPU limit) whose L1 norms differ in the last bit,
    in one order when summed block by block and in the other when summed whole: the column the
    per-matrix ops pick is updated (one column selected)."""
    rows, cols = 400, 300
    for seed in range(400):  # a momentum where the two summation orders disagree on columns 1 and 2
        gen = torch.Generator().manual_seed(seed)
        v = torch.randn(rows, generator=gen)
        m = torch.randn(rows, cols, generator=gen) * 1e-3
        m[:, 0], m[:, 1], m[:, 2] = 1e3, v, v[torch.randperm(rows, generator=gen)]
        blocked, whole = selection.l1_norms([m], 1)[0], torch.abs(m).sum(dim=0)
        if blocked[1] != blocked[2] and whole[1] != whole[2] and (blocked[1] > blocked[2]) != (whole[1] > whole[2]):
            break
    else:
        pytest.skip("no near-tie found on this CPU's summation order")
    p = torch.nn.Parameter(torch.zeros(rows, cols))
    opt = orthoptim.Dion2([{"params": [p], "fraction": 2 / cols, "weight_decay": 0.0}], lr=0.1)
    p.grad = m.clone()
    opt.step()
    expected = 1 if blocked[1] > blocked[2] else 2
    assert (p.detach().abs().sum(0) > 0).nonzero().flatten().tolist() == [0, expected]


def test_loading_its_own_state_dict_permuted_moves_each_state_once():
    """The loaded tensors are views of the stack they are copied into: each is copied out first (else
    the first copy overwrote the source of a later one: both matrices ended with one momentum)."""
    params = _model()
    opt = _optimizer("dion3", params)
    for t in range(2):
        _grads(params, t)
        opt.step()
    before = [opt.state[p]["momentum"].clone() for p in params[:2]]
    saved = opt.state_dict()
    saved["state"] = {**saved["state"], 0: saved["state"][1], 1: saved["state"][0]}
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[params[0]]["momentum"], before[1])
    assert torch.equal(opt.state[params[1]]["momentum"], before[0])
    assert stacked_view([opt.state[p]["momentum"] for p in params[:3]]) is not None


def test_pickling_writes_each_state_once_and_unpickles_stacked():
    """pickle writes a view's whole storage, once per view: the optimizer pickles each stack once, with
    where each view lies in it (as large as unstacked state), and unpickles stacked, continuing
    bit-identically."""
    params = _model()
    opt = _optimizer("dion3", params)
    _grads(params, 0)
    opt.step()
    blob = pickle.dumps(opt)
    state_bytes = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                      if isinstance(t, torch.Tensor))
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert len(blob) < 1.1 * (state_bytes + param_bytes) + 65536
    copy_ = pickle.loads(blob)
    copied = [p for g in copy_.param_groups for p in g["params"]]
    assert stacked_view([copy_.state[p]["momentum"] for p in copied[:3]]) is not None
    for ps, o in ((params, opt), (copied, copy_)):
        _grads(ps, 1)
        o.step()
    for x, y in zip(params, copied, strict=True):
        assert torch.equal(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stacked path on a GPU needs CUDA")
@pytest.mark.parametrize("dim", [0, 1])
def test_on_a_gpu_batched_norms_are_the_per_matrix_ones_to_rounding(dim):
    """On a GPU every size is stacked. CUDA sizes a reduction's split by its number of outputs, so B·m
    rows summed together may round otherwise than m rows alone (few, long rows): equal to rounding,
    not necessarily bit for bit (docs/architecture.md, State)."""
    gen = torch.Generator().manual_seed(6)
    for shape in [(1, 4096), (4, 2048), (8, 1024), (64, 64), (4096, 16)]:
        stack = torch.randn((3, *shape), generator=gen).cuda()
        grads = [torch.randn(shape, generator=gen).cuda() for _ in range(3)]
        alone = [m.clone() for m in stack.unbind(0)]
        got = selection.accumulate_and_l1_norms_stacked_(stack, list(stack.unbind(0)), grads, dim)
        for m, g in zip(alone, grads):
            m.add_(g)
        torch.testing.assert_close(got, selection.l1_norms(alone, dim), rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the stacked path on a GPU needs CUDA")
@pytest.mark.parametrize("name", ["dion3", "dion2"])
def test_on_a_gpu_stacked_steps_are_the_per_matrix_steps(monkeypatch, name):
    def run(stacked: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda())
                  for s in [(4, 2048)] * 3 + [(64, 64)] * 3 + [(8, 1024)] * 2]
        cls = {"dion3": orthoptim.Dion3, "dion2": orthoptim.Dion2}[name]
        opt = cls(params, lr=0.02, fraction=0.3)
        with monkeypatch.context() as mp:
            if not stacked:
                mp.setattr(base.OrthonormalOptimizer, "_selection_stacks", lambda *_: None)
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen).cuda()
                opt.step()
        return [p.detach().cpu() for p in params]

    for a, b in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(a, b)  # random rows: no near-tie, the same rows selected


def test_loading_copies_into_the_stacks_without_restacking(monkeypatch):
    """torch.optim's load_state_dict calls __setstate__ too: restacking there built a throwaway stack
    (a copy of the whole state) before the values were copied into the held one."""
    params = _model()
    opt = _optimizer("dion3", params)
    _grads(params, 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():  # standalone tensors, as a checkpoint saved without stacks has
        for key, value in entry.items():
            entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    restacked = []
    monkeypatch.setattr(base, "restack", lambda tensors: restacked.append(len(tensors)) or [])
    held = [opt.state[p]["momentum"] for p in params[:3]]
    opt.load_state_dict(saved)
    assert restacked == []
    assert all(opt.state[p]["momentum"] is m for p, m in zip(params[:3], held))


def test_standalone_state_of_an_older_pickle_is_stacked_when_unpickled():
    """An optimizer pickled before its state was stacked hands over standalone tensors."""
    params = _model()
    opt = _optimizer("dion3", params)
    _grads(params, 0)
    opt.step()
    state = opt.__getstate__()
    state["state"] = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                      for p, entry in opt.state.items()}
    restored = object.__new__(type(opt))
    restored.__setstate__(state)
    assert stacked_view([restored.state[p]["momentum"] for p in params[:3]]) is not None
    assert stacked_view([restored.state[p]["variance"] for p in params[:3]]) is not None
    for p in params:
        for key, value in opt.state[p].items():
            assert torch.equal(restored.state[p][key], value), key


def test_a_state_tensor_that_views_another_buffer_is_copied_alone():
    """A momentum replaced by hand with a view of a big buffer: pickled as its own copy, not the buffer."""
    params = _model()
    opt = _optimizer("dion3", params)
    big = torch.zeros(1 << 20)
    opt.state[params[0]]["momentum"] = big[: 16 * 24].view(16, 24)
    assert len(pickle.dumps(opt)) < 2 * sum(p.numel() * p.element_size() for p in params) + (1 << 19)


@pytest.mark.parametrize("how", ["clear", "new dict"])
@pytest.mark.parametrize("name", ["dion3", "dion2"])
def test_state_reset_by_hand_is_made_again_in_stacks(monkeypatch, name, how):
    """opt.state.clear() (or a fresh dict) between steps: the next step makes the state again as one
    stack, as the constructor did (it used to make each tensor alone, and the batched selection was
    gone for good), and continues as a fresh optimizer would from the same parameters."""
    calls = _spy_on_batched_norms(monkeypatch)
    params = _model()
    opt = _optimizer(name, params)
    for t in range(2):
        _grads(params, t)
        opt.step()
    if how == "clear":
        opt.state.clear()
    else:
        opt.state = collections.defaultdict(dict)
    fresh_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _optimizer(name, fresh_params)
    counts = {id(opt): 0, id(fresh): 0}
    for t in range(2, 4):
        for ps, o in ((params, opt), (fresh_params, fresh)):
            _grads(ps, t)
            calls.clear()
            o.step()
            counts[id(o)] += len(calls)
    assert counts[id(fresh)] > 0 and counts[id(opt)] == counts[id(fresh)], "no batched selection after the reset"
    assert stacked_view([opt.state[p]["momentum"] for p in params[:3]]) is not None
    for x, y in zip(params, fresh_params, strict=True):
        assert torch.equal(x, y)
        for key, value in opt.state[x].items():
            assert torch.equal(value, fresh.state[y][key]), key


def test_no_step_state_follows_the_default_device():
    """Under ``with torch.device(...)`` or torch.set_default_device, the state and scratch of CPU
    parameters stay on the CPU: Dion's initial factors came from a CPU generator onto the default
    device (an error for a CUDA default), the row selection's scratch was made there. A default
    device without data (meta) makes any tensor that follows it fail or compute nothing."""
    results = {}
    for default in (None, "meta"):
        params = _model()

        def under_default(default=default):
            return torch.device(default) if default else contextlib.nullcontext()
        with under_default():
            opts = [_optimizer("dion3", params[:3] + params[-1:]),
                    orthoptim.Dion([{"params": params[3:5]}], lr=0.02, rank_fraction=0.5)]
        for t in range(2):
            _grads(params, t)
            with under_default():
                for o in opts:
                    o.step()
        results[default] = [p.detach().clone() for p in params]
    for x, y in zip(results[None], results["meta"], strict=True):
        assert torch.equal(x, y)
