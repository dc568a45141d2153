"""`orthoptim bench` on a tiny parameter set: JSON, table, ratios, accuracy, errors."""

from __future__ import annotations

import json

import pytest
import torch

from orthoptim.cli import main


def test_bench_tiny_writes_json_table_and_plot(tmp_path, capsys):
    out = tmp_path / "bench"
    # torch.optim.Muon (the torch_muon row) exists from torch 2.9 on
    names = ["adamw", "torch_muon", "muon", "dion3", "dion_r0.25"] if hasattr(torch.optim, "Muon") else \
        ["adamw", "muon", "dion3", "dion_r0.25"]
    args = ["bench", "--d-model", "16", "--layers", "1", "--warmup", "0", "--repeats", "2", "--quiet",
            "--optimizers", ",".join(names), "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "vs AdamW" in printed and "orth error" in printed
    assert "iterations on this CPU: orthoptim in float32" in printed  # conftest pins float32
    assert "orthoptim in float32" in (out / "summary.txt").read_text()
    results = json.loads((out / "bench.json").read_text())
    assert results["d_model"] == 16 and results["layers"] == 1 and results["parameters"] == 4 * 16 * 16 + 2 * 64 * 16
    rows = {r["optimizer"]: r for r in results["rows"]}
    assert list(rows) == names
    assert rows["adamw"]["vs_adamw"] == pytest.approx(1.0)
    if "torch_muon" in rows:
        assert rows["torch_muon"]["vs_torch_muon"] == pytest.approx(1.0)
    for r in rows.values():
        assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
    assert rows["adamw"]["orth_error"] is None and rows["dion_r0.25"]["orth_error"] is None
    assert 0 < rows["muon"]["orth_error"] < 0.5
    assert set(rows["dion3"]["orth_error_by_shape"]) == {"4x16", "16x16", "4x64"}  # a quarter of the rows
    assert (out / "bench.png").stat().st_size > 5_000
    assert results["environment"]["orthoptim_cpu_dtype"] == "float32 -> float32"  # conftest pins it


@pytest.mark.parametrize(("args", "message"), [
    (["--optimizers", "adamw,sgd"], "--optimizers: unknown sgd"),
    (["--d-model", "64"], "give --d-model and --layers together"),
    (["--model", "124m", "--d-model", "64", "--layers", "2"], "either --model or --d-model/--layers"),
    (["--model", "huge"], "invalid choice: 'huge'"),
    (["--repeats", "0"], "--repeats 0 must be >= 1"),
    (["--optimizers", "dion3,muon,dion3"], "names dion3 more than once"),
    (["--device", "meta"], "--device meta: only cpu and cuda are supported"),
])
def test_bench_invalid_options(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["bench", *args]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
