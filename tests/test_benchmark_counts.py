"""The step counters (FLOPs, bytes moved, transient memory, state bytes) against known answers, and a
smoke run of benchmarks/ladder.py on a tiny set."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import orthoptim
from orthoptim.benchmark import (
    gpt_matrix_shapes,
    make_params,
    parse_set,
    smallest_winning_size,
    symmetric_newton_schulz,
)
from orthoptim.benchmark_counts import (
    TrafficMode,
    count_step,
    largest_megabatch_bytes,
    megabatch_bytes,
    state_bytes,
    tensor_bytes,
)
from orthoptim.optim import base

F32 = 4


def test_matmul_flops_and_bytes_are_exact():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    counts = count_step(lambda: a @ b, [a])
    assert counts.flops == 2 * 64 * 32 * 16
    assert counts.bytes_moved == (64 * 32 + 32 * 16 + 64 * 16) * F32  # read a and b, write the product
    assert counts.matmul_bytes == counts.bytes_moved and counts.elementwise_passes == 0
    assert counts.passes == counts.bytes_moved / (64 * 32 * F32)


def test_in_place_matmuls_and_factorizations_are_counted():
    """FlopCounterMode alone misses addmm_ / baddbmm_ (Dion's error feedback and update) and linalg."""
    a, b, c = torch.randn(64, 32), torch.randn(32, 16), torch.randn(64, 16)
    assert count_step(lambda: c.addmm_(a, b), [c]).flops == 2 * 64 * 32 * 16
    x, y, z = torch.randn(3, 8, 5), torch.randn(3, 5, 7), torch.randn(3, 8, 7)
    assert count_step(lambda: z.baddbmm_(x, y), [z]).flops == 2 * 3 * 8 * 5 * 7
    lower = torch.eye(16) + torch.randn(16, 16).tril(-1) * 0.1
    rhs = torch.randn(32, 16)
    solve = count_step(lambda: torch.linalg.solve_triangular(lower.mT, rhs, upper=True, left=False), [rhs])
    assert solve.flops == 16 * 16 * 32


def test_elementwise_bytes():
    n = 1000
    x, y = torch.randn(n), torch.randn(n)
    assert count_step(lambda: x.add_(y), [x]).bytes_moved == 3 * n * F32  # read x, y; write x
    assert count_step(lambda: x + y, [x]).bytes_moved == 3 * n * F32  # read x, y; write the sum
    assert count_step(lambda: x.copy_(y), [x]).bytes_moved == 2 * n * F32  # copy_ does not read x
    assert count_step(lambda: x.view(10, 100).mT, [x]).bytes_moved == 0  # views are free
    assert count_step(lambda: torch.empty(n), [x]).bytes_moved == 0  # so is an allocation
    xs, ys = [torch.randn(n) for _ in range(3)], [torch.randn(n) for _ in range(3)]
    counts = count_step(lambda: torch._foreach_add_(xs, ys), xs)
    assert counts.bytes_moved == 3 * 3 * n * F32 and counts.passes == 3.0
    assert count_step(lambda: x.addcmul_(y, y), [x]).bytes_moved == 3 * n * F32  # y is read once
    a, b = torch.randn(4, 64, 32), torch.randn(32, 16)  # matmul folds a into a 2-D view (_unsafe_view)
    assert count_step(lambda: a @ b, [a]).bytes_moved == (4 * 64 * 32 + 32 * 16 + 4 * 64 * 16) * F32


def test_gathers_and_scatters_touch_only_the_selected_rows():
    m = torch.randn(100, 50)
    idx = torch.tensor([3, 7, 11])
    rows = torch.randn(3, 50)
    index_bytes = 3 * 8
    assert count_step(lambda: m.index_select(0, idx), [m]).bytes_moved == 2 * 3 * 50 * F32 + index_bytes
    assert count_step(lambda: m.index_copy_(0, idx, rows), [m]).bytes_moved == 2 * 3 * 50 * F32 + index_bytes
    assert count_step(lambda: m.index_add_(0, idx, rows), [m]).bytes_moved == 3 * 3 * 50 * F32 + index_bytes
    assert count_step(lambda: m.index_fill_(0, idx, 0.0), [m]).bytes_moved == 3 * 50 * F32 + index_bytes


def test_transient_of_a_known_temporary():
    n = 1 << 20

    def step():
        a = torch.empty(n, dtype=torch.uint8)
        b = torch.empty(n, dtype=torch.uint8)
        del a
        c = torch.empty(n, dtype=torch.uint8)  # reuses a's bytes: the peak stays at two buffers
        del b, c

    counts = count_step(step, [torch.zeros(1)])
    assert counts.peak_transient_bytes == 2 * n
    assert counts.transient_source == "cpu profiler"
    with TrafficMode() as mode:  # the tracker, where the profiler cannot report allocations
        step()
    assert mode.peak_bytes == 2 * n


def test_transient_includes_what_an_op_allocates_inside_itself():
    """An SVD's LAPACK workspace is no output of any op: the CPU profiler's allocations see it, the
    dispatch tracker (outputs only) does not."""
    a = torch.randn(300, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outputs = (300 * 200 + 200 + 200 * 200) * 8

    def step():
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        del u, s, vh

    with TrafficMode() as mode:
        step()
    assert mode.peak_bytes == outputs
    assert count_step(step, [torch.zeros(1)]).peak_transient_bytes > outputs


def test_an_out_tensor_that_an_op_resizes_is_an_allocation():
    x = torch.randn(256, 256)
    with TrafficMode() as mode:
        y = torch.mul(x, 2, out=torch.empty(0))
        assert mode.live_bytes == x.numel() * F32
        del y
    assert mode.peak_bytes == x.numel() * F32


def test_transient_released_before_the_step_ends_and_views_are_not_allocations():
    x = torch.randn(256, 256)
    with TrafficMode() as mode:
        y = x * 2  # one new buffer
        view = y.mT  # a view: no allocation
        x.mul_(3)  # in place: no allocation
        assert mode.live_bytes == x.numel() * F32
        del y
        assert mode.live_bytes == x.numel() * F32  # the view keeps the buffer alive
        del view
    assert mode.live_bytes == 0 and mode.peak_bytes == x.numel() * F32


def test_state_bytes_match_the_design():
    shapes = gpt_matrix_shapes(16, 1)
    params = make_params(shapes)
    p_bytes = tensor_bytes(params)
    rows = sum(m for m, _ in shapes)
    assert state_bytes(orthoptim.Muon(params)) == p_bytes
    assert state_bytes(orthoptim.Dion3(params)) == p_bytes + F32 * rows  # one fp32 variance per row
    rank = [max(1, math.ceil(min(m, n) / 4)) for m, n in shapes]
    dion = orthoptim.Dion(params, rank_fraction=0.25)
    assert state_bytes(dion) == p_bytes + sum(n * r * F32 for (_, n), r in zip(shapes, rank))
    adamw = torch.optim.AdamW(params, foreach=True)
    adamw.step()  # torch creates AdamW's state on the first step
    assert state_bytes(adamw) == 2 * p_bytes  # the 0-dim step counters are not counted


def test_adamw_passes():
    """Fused AdamW moves the minimum: read X, G, m, v, write X, m, v = 7 passes over parameter memory."""
    params = make_params(gpt_matrix_shapes(16, 1))
    fused = torch.optim.AdamW(params, fused=True)
    fused.step()
    assert count_step(fused.step, params).passes == pytest.approx(7.0, abs=0.01)  # + the step counters


def test_megabatches():
    params = make_params([(4, 8)] * 3 + [(8, 4)] * 2 + [(4, 8)])
    groups = megabatch_bytes(params)
    assert sorted(groups.values()) == [2 * 32 * F32, 4 * 32 * F32]
    assert largest_megabatch_bytes(params) == 4 * 32 * F32


def test_muon_step_counts():
    """One Muon step on one k×n matrix: exactly 5 Polar Express iterations of 2k²n + 2k³ + 2k²n FLOPs;
    momentum and update move at least 5 passes; the state is the momentum."""
    k, n = 8, 16
    params = make_params([(k, n)])
    opt = orthoptim.Muon(params)
    opt.step()
    counts = count_step(opt.step, params)
    assert counts.flops == 5 * (4 * k * k * n + 2 * k**3)
    assert counts.elementwise_passes >= 5
    assert counts.peak_transient_bytes >= k * n * F32  # at least the orthogonalized update
    ops = counts.ops
    # Per iteration: A = X Xᵀ (bmm), aI + bA + cA² (baddbmm), then (aI + bA + cA²) X (bmm), except
    # in the last, where that product is the addmm_ that also decays and updates the parameter.
    assert ops["bmm"]["calls"] == 9 and ops["baddbmm"]["calls"] == 5 and ops["addmm_"]["calls"] == 1


def _gram_restarting_twice(x):
    return orthoptim.gram_newton_schulz(x, restarts=(2, 4))


@pytest.mark.parametrize("restarts", [1, 2])
def test_gram_newton_schulz_step_flops(monkeypatch, restarts):
    """Gram NS on one k×n matrix, every product dense (k below the blocked sizes). k×n products:
    R = X Xᵀ at the start and after each restart, Q X at each restart and at the end, 2k²n each.
    k×k products (2k³ each), per iteration: the polynomial P, Q ← Q P (not on the first iteration
    after a (re)start, where Q = P) and R ← P R P (two; not before a restart or at the end).
    In bf16 "gram" is standard NS (Gram NS is unstable there), with standard NS's FLOPs."""
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    k, n = 8, 32
    params = make_params([(k, n)])
    opt = orthoptim.Muon(params, orthogonalizer="gram" if restarts == 1 else _gram_restarting_twice)
    opt.step()
    restart_at = {2} if restarts == 1 else {2, 4}
    small = 0
    for i in range(5):
        fresh = i == 0 or i in restart_at
        small += 1 + (0 if fresh else 1) + (0 if i == 4 or i + 1 in restart_at else 2)
    wide = 2 + 2 * restarts  # R at the start and per restart; Q X per restart and at the end
    assert count_step(opt.step, params).flops == wide * 2 * k * k * n + small * 2 * k**3
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "bfloat16")
    bf16 = orthoptim.Muon(params, orthogonalizer="gram")
    bf16.step()
    assert count_step(bf16.step, params).flops == 5 * (4 * k * k * n + 2 * k**3)


def test_dion3_step_flops_are_the_selected_rows_gram_newton_schulz(monkeypatch):
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    m, n, fraction = 32, 16, 0.25
    params = make_params([(m, n)])
    opt = orthoptim.Dion3(params, fraction=fraction)
    opt.step()
    k = math.ceil(fraction * m)  # 8 rows of 16: fp32 Gram NS with one restart (the test above)
    assert count_step(opt.step, params).flops == 8 * k * k * n + 28 * k**3


def test_dion_step_flops():
    """Rank r on m×n: P = B Q and R = Bᵀ P, the error feedback P Rᵀ and the update P Q'ᵀ (2mnr each);
    Cholesky-QR twice on P: PᵀP (2mr²), the Cholesky factor (r³/3), the triangular solve (mr²)."""
    m, n = 24, 16
    params = make_params([(m, n)])
    opt = orthoptim.Dion(params, rank_fraction=0.25)
    opt.step()
    r = math.ceil(min(m, n) / 4)
    assert count_step(opt.step, params).flops == 4 * 2 * m * n * r + 2 * (3 * m * r * r + int(r**3 / 3))


def test_symmetric_newton_schulz_equals_standard():
    x = torch.randn(3, 12, 20)
    assert torch.allclose(symmetric_newton_schulz(x), orthoptim.newton_schulz(x), atol=1e-6)
    assert torch.allclose(symmetric_newton_schulz(x.mT), orthoptim.newton_schulz(x.mT), atol=1e-6)


def test_parse_set():
    assert parse_set("124m") == ("124m", 768, 12, 12)
    assert parse_set("1b:2") == ("1b:2", 2048, 2, 16)
    assert parse_set("1b:16") == ("1b", 2048, 16, 16)
    assert parse_set("d64x3") == ("d64x3", 64, 3, 3)
    for bad in ("huge", "1b:0", "1b:x"):
        with pytest.raises(ValueError):
            parse_set(bad)


def _benchmark(script: str, module_name: str, register: bool = False):
    """benchmarks/<script> loaded as a module (benchmarks/ is no package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[module_name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _ladder():
    return _benchmark("ladder.py", "ladder", register=True)


def test_ladder_smoke(tmp_path, capsys):
    ladder = _ladder()
    out = tmp_path / "ladder.json"
    assert ladder.main(["--sets", "d32x1,7b", "--device", "cpu", "--warmup", "1", "--repeats", "1",
                        "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "| set | optimizer | median ms |" in printed.out
    assert "skipping 7b" in printed.err  # GPU-only
    results = json.loads(out.read_text())
    expected = ["adamw", "adamw_fused", "muon", "muon_bmm", "muon+sym", "muon+gram", "dion3_f1/2", "dion3_f1/4",
                "dion3_f1/8", "dion_r1/4", "torch_muon"]
    assert [r["optimizer"] for r in results["rows"]] == expected
    assert list(results["sets"]) == ["d32x1"]
    for r in results["rows"]:
        assert set(results["columns"]) <= set(r), r["optimizer"]
        if r["median_ms"] is None:
            assert r["note"].startswith("skipped:") and r["optimizer"] in ("adamw_fused", "torch_muon")
            continue
        assert r["median_ms"] > 0 and r["passes"] > 0 and r["state_bytes"] > 0
    rows = {r["optimizer"]: r for r in results["rows"]}
    assert rows["muon"]["vs_muon"] == pytest.approx(1.0) and rows["adamw"]["vs_adamw"] == pytest.approx(1.0)
    assert rows["muon"]["state_ratio"] == pytest.approx(1.0) and rows["adamw"]["state_ratio"] == pytest.approx(2.0)
    assert rows["muon"]["gflop"] > rows["dion3_f1/4"]["gflop"] > 0 and rows["adamw"]["gflop"] == 0
    assert "torch fallback" in rows["muon+sym"]["note"]
    assert results["environment"]["threads"] == 1
    # The tables and the plot again from the JSON alone, without measuring.
    png = tmp_path / "ladder.png"
    assert ladder.main(["--from-json", str(out), "--png", str(png)]) == 0
    assert "| d32x1 | muon |" in capsys.readouterr().out
    assert png.stat().st_size > 5_000


def test_ladder_records_a_failing_rung_and_runs_the_rest(tmp_path, capsys, monkeypatch):
    """One rung that raises (a kernel error on a GPU, say) must not cost the rungs after it."""
    ladder = _ladder()
    real = ladder.run_rung

    def run_rung(rung, *args, **kwargs):
        if rung.name == "muon":
            raise RuntimeError("broken kernel")
        return real(rung, *args, **kwargs)

    monkeypatch.setattr(ladder, "run_rung", run_rung)
    out = tmp_path / "ladder.json"
    assert ladder.main(["--sets", "d32x1", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                        "--optimizers", "adamw,muon,dion3_f1/4", "--json", str(out)]) == 1
    rows = {r["optimizer"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["muon"]["median_ms"] is None and "RuntimeError: broken kernel" in rows["muon"]["note"]
    assert rows["adamw"]["median_ms"] > 0 and rows["dion3_f1/4"]["median_ms"] > 0
    assert "broken kernel" in capsys.readouterr().err


def test_ladder_on_a_bf16_cpu_adds_fp32_twins_and_pools_rounds(tmp_path, monkeypatch):
    """Where the CPU default is bf16, the ladder also runs fp32 twins of Muon, Gram and Dion3 (fp32 is
    what other CPUs run), under ORTHOPTIM_CPU_DTYPE=float32 for that rung only; --rounds pools the
    repeats of every round."""
    from orthoptim.kernels import cpu_dtype

    monkeypatch.setenv(cpu_dtype.ENV_VAR, "bfloat16")
    ladder = _ladder()
    seen = {}
    real = ladder._run_rung

    def spy(rung, *args, **kwargs):
        seen[rung.name] = cpu_dtype.iteration_dtype()
        return real(rung, *args, **kwargs)

    monkeypatch.setattr(ladder, "_run_rung", spy)
    out = tmp_path / "ladder.json"
    assert ladder.main(["--sets", "d32x1", "--device", "cpu", "--warmup", "0", "--repeats", "2", "--rounds", "2",
                        "--budget-s", "600", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    rows = {r["optimizer"]: r for r in results["rows"]}
    assert {"muon_fp32", "muon+gram_fp32", "dion3_f1/4_fp32"} <= set(rows)
    assert seen["muon"] == torch.bfloat16 and seen["muon_fp32"] == torch.float32
    assert seen["dion3_f1/4_fp32"] == torch.float32 and cpu_dtype.iteration_dtype() == torch.bfloat16  # restored
    assert "bf16" in rows["muon"]["note"] and "'gram' in bf16: standard NS" in rows["muon+gram"]["note"]
    assert rows["muon+gram_fp32"]["note"].startswith("Gram NS, fp32")
    assert len(rows["muon"]["times_ms"]) == 4 and rows["muon"]["median_ms"] == pytest.approx(
        statistics.median(rows["muon"]["times_ms"]))
    assert results["rounds"] == 2 and results["environment"]["orthoptim_cpu_dtype"] == "bfloat16 -> bfloat16"


def _step_phases():
    return _benchmark("step_phases.py", "step_phases")


@pytest.mark.parametrize(("name", "expected"), [
    # d32x1's 32×32 and 128×32 matrices are small: their Dion2/Dion3 state is stacked (stacked_state)
    ("dion3", {"momentum M ← M + G + L1 norms (stacked state)", "normalize + decay + update (Dion3)",
               "error-feedback decay", "non-finite check", "orthogonalize [4, 8, 32]"}),
    ("dion2", {"momentum M ← M + G + L1 norms (stacked state)", "gather selected rows", "non-finite check"}),
    ("muon", {"momentum + stack (Muon)", "last product + decay + update (Muon)", "orthogonalize [1, 32, 128]"}),
])
def test_step_phases_times_the_phases_and_restores_the_functions(tmp_path, capsys, name, expected):
    phases = _step_phases()
    originals = [owner.__dict__.get(fn) for owner, fn, _ in phases.PHASES]
    out = tmp_path / "phases.json"
    assert phases.main(["--optimizer", name, "--set", "d32x1", "--warmup", "1", "--repeats", "2",
                        "--json", str(out)]) == 0
    assert "| phase | median ms | share of step |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = {r["phase"]: r for r in result["phases"]}
    assert expected <= set(rows), sorted(rows)
    # Outermost phases only (decay_ inside Muon's update is not counted twice): they fit in the step.
    timed = sum(r["median_ms"] for p, r in rows.items() if not p.startswith("not in"))
    assert 0 < timed <= 1.05 * max(result["step_ms"])
    assert [owner.__dict__.get(fn) for owner, fn, _ in phases.PHASES] == originals


def _paired():
    return _benchmark("paired.py", "paired_benchmark")


def test_paired_steps_alternate_which_side_goes_first():
    paired = _paired()
    order = []
    a, b = paired.paired_times(lambda: order.append("a"), lambda: order.append("b"), steps=4, warmup=1,
                               device=torch.device("cpu"))
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(a) == len(b) == 4 and all(t >= 0 for t in a + b)
    assert paired.quartiles([3.0]) == (3.0, 3.0, 3.0)
    assert paired.quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)


def test_paired_smoke(tmp_path, capsys):
    paired = _paired()
    out = tmp_path / "paired.json"
    assert paired.main(["--set", "d32x1", "--pairs", "muon:dion3_f1/4,adamw:muon_fp32", "--steps", "3",
                        "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| muon | dion3_f1/4 |" in printed and "| adamw | muon_fp32 |" in printed
    result = json.loads(out.read_text())
    assert [(p["a"], p["b"]) for p in result["pairs"]] == [("muon", "dion3_f1/4"), ("adamw", "muon_fp32")]
    for p in result["pairs"]:
        ratios = [b / a for a, b in zip(p["a_ms"], p["b_ms"])]
        assert p["ratio_median"] == pytest.approx(statistics.median(ratios))
        assert p["ratio_q1"] <= p["ratio_median"] <= p["ratio_q3"]
        assert p["b_slower_share"] == pytest.approx(sum(r > 1 for r in ratios) / 3)
    with pytest.raises(SystemExit, match=r"unknown rung\(s\) nope;"):  # before the first pair runs
        paired.main(["--set", "d32x1", "--pairs", "adamw:muon,muon:nope", "--steps", "1"])
    assert "| adamw | muon |" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="A:B pairs"):
        paired.main(["--set", "d32x1", "--pairs", "muon", "--steps", "1"])


def test_smallest_winning_size():
    assert smallest_winning_size({256: False, 512: True, 1024: True}) == 512
    assert smallest_winning_size({256: True, 512: False, 1024: True}) == 1024  # a loss above resets it
    assert smallest_winning_size({256: True, 1024: False}) is None
    assert smallest_winning_size({}) is None


def test_cpu_symmetric_bench_suggestion_needs_every_row_at_and_above_k():
    bench = _benchmark("cpu_symmetric_bench.py", "cpu_symmetric_bench")
    block = bench.cpu_symmetric.BLOCK

    def row(k, gram, poly):
        return {"k": k, "blocks": {block: {"gram_speedup": gram, "polynomial_speedup": poly}}}

    rows = [row(512, 1.2, 0.9), row(768, 1.3, 1.1), row(768, 1.2, 1.05), row(1024, 1.5, 1.4)]
    assert bench.suggested_min_size(rows) == 768
    rows.append(row(1024, 1.4, 0.99))  # one thread count losing at 1024 leaves no threshold
    assert bench.suggested_min_size(rows) is None
    assert bench.suggested_min_size([{"k": 256, "blocks": {}}]) is None  # block not measured: not a win


def test_cpu_symmetric_bench_wide_gram_suggestion_needs_every_aspect():
    bench = _benchmark("cpu_symmetric_bench.py", "cpu_symmetric_bench")

    def row(k, *speedups):
        return {"k": k, "wide_gram_speedup": dict(zip((2, 4), speedups))}

    rows = [row(256, 0.9, 1.1), row(384, 1.1, 1.2), row(512, 1.2, 1.3), row(384, 1.05, 1.3)]
    assert bench.suggested_min_wide_gram_size(rows) == 384
    rows.append(row(384, 1.2, 0.98))  # one thread count losing at one aspect moves it up
    assert bench.suggested_min_wide_gram_size(rows) == 512


@pytest.mark.parametrize("closed", ["fd", "sys.stderr"])
def test_counting_works_with_stderr_closed(closed):
    """The profiler's log lines are silenced on fd 2; with fd 2 closed or sys.stderr None there is
    nothing to silence, and the count must still come out."""
    close = "os.close(2)" if closed == "fd" else "sys.stderr = None"
    code = ("import os, sys, torch\n"
            "from orthoptim.benchmark_counts import count_step\n"
            f"{close}\n"
            "counts = count_step(lambda: torch.empty(1 << 20, dtype=torch.uint8).fill_(1), [torch.zeros(1)])\n"
            "print(counts.peak_transient_bytes, counts.transient_source)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(1 << 20), "cpu", "profiler"]


def test_the_stacked_state_benchmark_times_both_sides_and_restores_the_method(tmp_path, capsys):
    bench = _benchmark("stacked_state.py", "stacked_state_benchmark")
    own = base.OrthonormalOptimizer._selection_stacks
    out = tmp_path / "stacked.json"
    assert bench.main(["--models", "1x16", "--optimizers", "dion3", "--steps", "2", "--warmup", "1",
                       "--json", str(out)]) == 0
    assert "| 1x16 | dion3 |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert len(row["stacked_ms"]) == len(row["per_matrix_ms"]) == 2 and row["ratio_median"] > 0
    assert base.OrthonormalOptimizer._selection_stacks is own
