"""An independent, unbatched reference of every update rule in DESIGN.md §1.

Written from the equations only: plain loops over matrices, plain torch ops, float64 throughout.
Nothing here imports orthoptim, so a shared bug cannot hide. The tests drive the real optimizers
and this reference side by side with the same gradients and compare after every step
(``build``, ``drive``, ``compare`` at the end; the optimizer classes are passed in).

The library's state layout is read, not reimplemented: ``momentum`` shaped like the parameter,
``variance`` [batch, rows], Dion's ``Q`` [matrices, cols, max rank], ``exp_avg`` / ``exp_avg_sq``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

F64 = torch.float64


# ----------------------------------------------------------------------------- exact polar factor
def polar(a: Tensor) -> Tensor:
    """orth(A) = U Vᵀ of A = U Σ Vᵀ for one matrix, in float64."""
    u, _, vh = torch.linalg.svd(a.to(F64), full_matrices=False)
    return u @ vh


def exact_polar_batch(x: Tensor) -> Tensor:
    """The ``orthogonalizer=`` callable the tests hand to the optimizers: [B, k, n] → [B, k, n]."""
    assert x.ndim == 3, f"an orthogonalizer receives a batch [B, k, n], got shape {tuple(x.shape)}"
    return torch.stack([polar(a) for a in x]).to(x.dtype)


class CountingPolar:
    """``exact_polar_batch`` that records the shape of every batch it is called with."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, x: Tensor) -> Tensor:
        self.shapes.append(tuple(x.shape))
        return exact_polar_batch(x)


# ----------------------------------------------------------------------------- small pieces
def lr_scale(m: int, n: int, adjust_lr: str | None) -> float:
    """s(m, n): "spectral_norm" → √(m/n), "rms_norm" → 0.2·√max(m, n), "original" → √max(1, m/n), None → 1."""
    if adjust_lr == "spectral_norm":
        return math.sqrt(m / n)
    if adjust_lr == "rms_norm":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr == "original":
        return math.sqrt(m / n) if m > n else 1.0
    assert adjust_lr is None
    return 1.0


def ceil_fraction(fraction: float, d: int) -> int:
    """ceil(fraction·d) as the smallest k whose share k/d, a float, reaches the fraction (0.3·10 = 3,
    not the 4 of the rounded product; 5/6·6 = 5)."""
    return next(k for k in range(d + 1) if k / d >= fraction)


def top_l1(m: Tensor, k: int, dim: int) -> list[int]:
    """Sorted indices of the k rows (dim=0) or columns (dim=1) of ``m`` with the largest L1 norm."""
    size = m.shape[dim]
    norms = [float(m[i].abs().sum()) if dim == 0 else float(m[:, i].abs().sum()) for i in range(size)]
    order = sorted(range(size), key=lambda i: -norms[i])
    return sorted(order[:k])


# ----------------------------------------------------------------------------- one matrix, one step
# Each function takes one matrix X (m×n) and its state, returns new copies, changes nothing in place.
def muon(x, g, m, *, lr, wd, mu, nesterov, s):
    m = mu * m + g
    b = g + mu * m if nesterov else m
    x = x * (1 - lr * wd) - lr * s * polar(b)
    return x, m


def normuon(x, g, m, v, *, lr, wd, mu, nesterov, beta2, eps, s):
    m = mu * m + g
    b = g + mu * m if nesterov else m
    o = polar(b)
    v = beta2 * v + (1 - beta2) * (o * o).mean(dim=1)
    o_hat = o / (v.sqrt() + eps)[:, None]
    o_hat = o_hat * (o.norm() / o_hat.norm())  # rescale to ‖O‖_F
    x = x * (1 - lr * wd) - lr * s * o_hat
    return x, m, v


def dion2(x, g, m, *, lr, wd, fraction, mu, s):
    """Rows when m ≤ n, columns otherwise. Returns (x, m, selected indices, dim)."""
    rows, cols = m.shape
    m = m + g
    dim = 0 if rows <= cols else 1
    sel = top_l1(m, ceil_fraction(fraction, m.shape[dim]), dim)
    m = m.clone()
    x = x * (1 - lr * wd)
    if dim == 0:
        u = m[sel, :].clone()
        m[sel, :] = mu * u
        x[sel, :] = x[sel, :] - lr * s * polar(u)
    else:
        u = m[:, sel].clone()
        m[:, sel] = mu * u
        x[:, sel] = x[:, sel] - lr * s * polar(u)
    return x, m, sel, dim


def dion3(x, g, m, v, *, lr, wd, fraction, mu, beta2, eps, s):
    """Rows always; V updated on the selected rows only. Returns (x, m, v, selected rows)."""
    m = m + g
    sel = top_l1(m, ceil_fraction(fraction, m.shape[0]), 0)
    m = m.clone()
    v = v.clone()
    u = m[sel, :].clone()
    m[sel, :] = mu * u
    o = polar(u)
    v[sel] = beta2 * v[sel] + (1 - beta2) * (o * o).mean(dim=1)
    o_hat = o / (v[sel].sqrt() + eps)[:, None]
    o_hat = o_hat * (o.norm() / o_hat.norm())
    x = x * (1 - lr * wd)
    x[sel, :] = x[sel, :] - lr * s * o_hat
    return x, m, v, sel


def dion(x, g, m, q, *, lr, wd, mu, eps, s):
    """Q is n×r. Returns (x, m, q, P, R); P's column signs are arbitrary (Householder QR)."""
    b = m + g
    p = torch.linalg.qr(b @ q, mode="reduced").Q
    r = b.T @ p
    m = b - (1 - mu) * p @ r.T
    q_new = r / (r.norm(dim=0, keepdim=True) + eps)
    x = x * (1 - lr * wd) - lr * s * p @ q_new.T
    q = torch.where((r == 0).all(dim=0, keepdim=True), q, q_new)  # a zero column of R keeps Q's
    return x, m, q, p, r


def adamw(x, g, m, v, t, *, lr, wd, beta1, beta2, eps):
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    m_hat = m / (1 - beta1**t)
    v_hat = v / (1 - beta2**t)
    x = x * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps)
    return x, m, v


def lion(x, g, m, *, lr, wd, beta1, beta2):
    x = x * (1 - lr * wd) - lr * torch.sign(beta1 * m + (1 - beta1) * g)
    m = beta2 * m + (1 - beta2) * g
    return x, m


# ----------------------------------------------------------------------------- matrix layout
@dataclass
class Layout:
    """A parameter seen as ``batch`` matrices of ``rows × cols``, each cut into row blocks."""

    batch: int
    rows: int
    cols: int
    blocks: list[tuple[int, int]]  # (first row, number of rows)
    transposed: bool = False  # each stored matrix is [cols, rows]

    def slices(self) -> list[tuple[int, int, int]]:
        """(batch index, first row, rows) of every matrix, batch-major."""
        return [(b, r0, size) for b in range(self.batch) for r0, size in self.blocks]


def layout(shape, *, flatten=False, num_heads=None, split_sizes=None, transpose=False) -> Layout:
    """2-D as is; 3-D = batch of matrices; flatten: [out, rest...] → [out, prod(rest)]; transpose:
    each of those matrices read transposed. split_sizes cut the rows into fused blocks; num_heads
    cuts every block into equal head blocks."""
    shape = tuple(shape)
    if flatten and len(shape) > 2:
        batch, rows, cols = 1, shape[0], math.prod(shape[1:])
    elif len(shape) == 3:
        batch, rows, cols = shape
    else:
        assert len(shape) == 2
        batch, rows, cols = 1, *shape
    if transpose:
        rows, cols = cols, rows
    parts = list(split_sizes) if split_sizes else [rows]
    heads = num_heads or 1
    blocks, start = [], 0
    for part in parts:
        for _ in range(heads):
            blocks.append((start, part // heads))
            start += part // heads
    assert start == rows
    return Layout(batch, rows, cols, blocks, transpose)


def matrix_of(t: Tensor, lay: Layout, b: int, r0: int, size: int) -> Tensor:
    """The [size, cols] matrix of a tensor shaped like the parameter (a view)."""
    if lay.transposed:
        return t.reshape(lay.batch, lay.cols, lay.rows)[b].T[r0 : r0 + size]
    return t.reshape(lay.batch, lay.rows, lay.cols)[b, r0 : r0 + size]


# ----------------------------------------------------------------------------- the reference optimizer
class Reference:
    """Runs the rules above, one matrix at a time, on float64 copies of the parameters.

    ``groups``: dicts with ``params`` (the real optimizer's tensors; cloned here), ``algorithm`` and
    every hyperparameter the rule reads (lr, weight_decay, mu, nesterov, muon_beta2, epsilon, fraction,
    rank_fraction, betas, adjust_lr, flatten, num_heads, split_sizes). ``initial_q``: for Dion, maps
    (group index, param index) to the list of per-matrix initial right factors (n×r), read from the
    real optimizer before its first step.
    """

    def __init__(self, groups: list[dict], initial_q: dict | None = None) -> None:
        self.groups = []
        for gi, group in enumerate(groups):
            opts = {k: v for k, v in group.items() if k != "params"}
            entries = []
            for pi, p in enumerate(group["params"]):
                x = p.detach().to(F64).clone()
                e = {"x": x}
                if opts["algorithm"] in ("adamw", "lion"):
                    e["m"] = torch.zeros_like(x)
                    e["v"] = torch.zeros_like(x)
                    e["t"] = 0
                else:
                    lay = layout(x.shape, flatten=opts.get("flatten", False), num_heads=opts.get("num_heads"),
                                 split_sizes=opts.get("split_sizes"), transpose=opts.get("transpose", False))
                    e["layout"] = lay
                    e["m"] = torch.zeros_like(x)
                    e["v"] = [torch.zeros(size, dtype=F64) for _, _, size in lay.slices()]
                    if opts["algorithm"] == "dion":
                        e["q"] = [q.detach().to(F64).clone() for q in initial_q[(gi, pi)]]
                    e["p"] = [None] * len(lay.slices())  # Dion's last P, for the tests
                entries.append(e)
            self.groups.append((opts, entries))

    def params(self) -> list[Tensor]:
        return [e["x"] for _, entries in self.groups for e in entries]

    def step(self, grads: list[list[Tensor]]) -> None:
        """``grads[gi][pi]``: the gradient of parameter pi of group gi."""
        for (o, entries), group_grads in zip(self.groups, grads):
            for e, g in zip(entries, group_grads):
                g = g.to(F64)
                alg = o["algorithm"]
                if alg == "adamw":
                    e["t"] += 1
                    e["x"], e["m"], e["v"] = adamw(e["x"], g, e["m"], e["v"], e["t"], lr=o["lr"],
                                                   wd=o["weight_decay"], beta1=o["betas"][0],
                                                   beta2=o["betas"][1], eps=o["epsilon"])
                    continue
                if alg == "lion":
                    e["x"], e["m"] = lion(e["x"], g, e["m"], lr=o["lr"], wd=o["weight_decay"],
                                          beta1=o["betas"][0], beta2=o["betas"][1])
                    continue
                self._matrix_step(o, e, g)

    def _matrix_step(self, o: dict, e: dict, g: Tensor) -> None:
        lay: Layout = e["layout"]
        x_new = e["x"].clone()
        m_new = e["m"].clone()
        common = {"lr": o["lr"], "wd": o["weight_decay"]}
        for i, (b, r0, size) in enumerate(lay.slices()):
            xi = matrix_of(e["x"], lay, b, r0, size)
            gi = matrix_of(g, lay, b, r0, size)
            mi = matrix_of(e["m"], lay, b, r0, size)
            s = lr_scale(size, lay.cols, o["adjust_lr"])
            alg = o["algorithm"]
            if alg == "muon":
                xo, mo = muon(xi, gi, mi, mu=o["mu"], nesterov=o["nesterov"], s=s, **common)
            elif alg == "normuon":
                xo, mo, e["v"][i] = normuon(xi, gi, mi, e["v"][i], mu=o["mu"], nesterov=o["nesterov"],
                                            beta2=o["muon_beta2"], eps=o["epsilon"], s=s, **common)
            elif alg == "dion2":
                xo, mo, _, _ = dion2(xi, gi, mi, fraction=o["fraction"], mu=o["mu"], s=s, **common)
            elif alg == "dion3":
                xo, mo, e["v"][i], _ = dion3(xi, gi, mi, e["v"][i], fraction=o["fraction"],
                                                            mu=o["mu"], beta2=o["muon_beta2"],
                                                            eps=o["epsilon"], s=s, **common)
            else:
                xo, mo, e["q"][i], e["p"][i], _ = dion(xi, gi, mi, e["q"][i], mu=o["mu"],
                                                               eps=o["epsilon"], s=s, **common)
            matrix_of(x_new, lay, b, r0, size).copy_(xo)
            matrix_of(m_new, lay, b, r0, size).copy_(mo)
        e["x"], e["m"] = x_new, m_new


def dion_rank(rank_fraction: float, m: int, n: int) -> int:
    """r = ceil(rank_fraction · min(m, n))."""
    return ceil_fraction(rank_fraction, min(m, n))


# ----------------------------------------------------------------------------- comparing with the real optimizer
def max_abs(t: Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def rel_err(got: Tensor, want: Tensor, scale: float | None = None) -> float:
    """max|got − want| / scale (default max|want|)."""
    scale = max_abs(want) if scale is None else scale
    return max_abs(got.to(F64) - want.to(F64)) / max(scale, 1e-300)


def align_column_signs(got: Tensor, want: Tensor) -> Tensor:
    """``got`` with each column's sign flipped to agree with ``want`` (QR column signs are not unique)."""
    signs = torch.sign((got.to(F64) * want.to(F64)).sum(dim=0, keepdim=True))
    signs[signs == 0] = 1.0
    return got.to(F64) * signs


def compare(opt, ref: Reference, x0: list[Tensor], *, tol_x: float, tol_state: float, tol_v: float | None = None,
            where: str = "") -> None:
    """Assert the real optimizer's parameters and state equal the reference's.

    Parameters: max error relative to the largest total change max|X_ref − X_0| (so a tiny lr cannot
    hide an error). Momentum, Q, Adam moments: relative to their own size. V: ``tol_v`` (default
    ``tol_state``).
    """
    tol_v = tol_state if tol_v is None else tol_v
    k = 0
    for (o, entries), group in zip(ref.groups, opt.param_groups):
        for pi, (e, p) in enumerate(zip(entries, group["params"])):
            name = f"{where} group {o['algorithm']} param {pi} {tuple(p.shape)}"
            change = max_abs(e["x"] - x0[k].to(F64))
            k += 1
            err = rel_err(p.detach(), e["x"], change)
            assert err <= tol_x, f"{name}: parameter differs from the reference by {err:.3g} (of the update)"
            st = opt.state[p]
            if o["algorithm"] == "adamw":
                assert rel_err(st["exp_avg"], e["m"]) <= tol_state, f"{name}: exp_avg"
                assert rel_err(st["exp_avg_sq"], e["v"]) <= tol_state, f"{name}: exp_avg_sq"
                continue
            if o["algorithm"] == "lion":
                assert rel_err(st["exp_avg"], e["m"]) <= tol_state, f"{name}: exp_avg"
                continue
            err = rel_err(st["momentum"], e["m"])
            assert err <= tol_state, f"{name}: momentum differs from the reference by {err:.3g}"
            lay: Layout = e["layout"]
            for i, (b, r0, size) in enumerate(lay.slices()):
                if o["algorithm"] in ("normuon", "dion3"):
                    v_lib = st["variance"].reshape(lay.batch, lay.rows)[b, r0 : r0 + size]
                    err = rel_err(v_lib, e["v"][i])
                    assert err <= tol_v, f"{name} matrix {i}: variance V differs by {err:.3g}"
                if o["algorithm"] == "dion":
                    q_ref = e["q"][i]
                    q_lib = st["Q"][i, :, : q_ref.shape[1]]
                    err = rel_err(align_column_signs(q_lib, q_ref), q_ref)
                    assert err <= tol_state, f"{name} matrix {i}: right factor Q differs by {err:.3g}"


# ----------------------------------------------------------------------------- driving the real optimizer
# (The optimizer classes are passed in, so this module never imports orthoptim.)
STEPS = 5
TOL_X = 1e-10  # max |X_lib − X_ref| / max |X_ref − X_0|
TOL_STATE = 1e-12  # momentum, Q, Adam moments, relative to their size

# Non-default values everywhere, so that a swapped or ignored hyperparameter shows.
HP = {"lr": 0.05, "weight_decay": 0.1, "mu": 0.9, "muon_beta2": 0.8, "epsilon": 1e-8, "fraction": 0.3,
      "rank_fraction": 0.5, "betas": (0.8, 0.9), "nesterov": False, "adjust_lr": "spectral_norm"}
CLASS_ARGS = {
    "muon": ("lr", "mu", "nesterov", "weight_decay", "epsilon", "adjust_lr"),
    "normuon": ("lr", "mu", "muon_beta2", "nesterov", "weight_decay", "epsilon", "adjust_lr"),
    "dion2": ("lr", "fraction", "mu", "weight_decay", "epsilon", "adjust_lr"),
    "dion3": ("lr", "fraction", "mu", "muon_beta2", "weight_decay", "epsilon", "adjust_lr"),
    "dion": ("lr", "rank_fraction", "mu", "weight_decay", "epsilon", "adjust_lr"),
}


def make_params(shapes, seed, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=F64).to(dtype).requires_grad_() for s in shapes]


def build(cls, algorithm, params, hp, orthogonalizer=None, **group_opts):
    """The real optimizer ``cls`` (hyperparameters through its constructor, the exact polar factor as
    its orthogonalizer unless another is given) and the reference, for one group of ``params``."""
    kwargs = {k: hp[k] for k in CLASS_ARGS[algorithm]}
    if algorithm != "dion":
        kwargs["orthogonalizer"] = orthogonalizer or exact_polar_batch
    opt = cls([{"params": params, **group_opts}], **kwargs)
    reference = Reference([{"params": params, "algorithm": algorithm, **hp, **group_opts}],
                          initial_q=initial_q(opt))
    return opt, reference


def initial_q(opt):
    """Dion's initial right factors, per matrix, read from the optimizer before its first step."""
    out = {}
    for gi, group in enumerate(opt.param_groups):
        if group["algorithm"] != "dion":
            continue
        for pi, p in enumerate(group["params"]):
            lay = layout(p.shape, flatten=group["flatten"], num_heads=group["num_heads"],
                         split_sizes=group["split_sizes"], transpose=group["transpose"])
            qs = []
            for i, (_, _, size) in enumerate(lay.slices()):
                r = dion_rank(group["rank_fraction"], size, lay.cols)
                qs.append(opt.state[p]["Q"][i, :, :r].clone())
            out[(gi, pi)] = qs
    return out


def drive(opt, reference, *, steps=STEPS, seed=0, tol_x=TOL_X, tol_state=TOL_STATE, tol_v=None, after_step=None):
    """Run both for ``steps`` steps with the same random gradients; compare after each."""
    gen = torch.Generator().manual_seed(1000 + seed)
    groups = [g["params"] for g in opt.param_groups]
    x0 = [p.detach().clone() for ps in groups for p in ps]
    for t in range(steps):
        grads = [[torch.randn(p.shape, generator=gen, dtype=F64).to(p.dtype) for p in ps] for ps in groups]
        before = [p.detach().clone() for ps in groups for p in ps]
        for ps, gs in zip(groups, grads):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
        opt.step()
        reference.step(grads)
        compare(opt, reference, x0, tol_x=tol_x, tol_state=tol_state, tol_v=tol_v, where=f"step {t + 1}")
        if after_step is not None:
            after_step(t, before, grads)
