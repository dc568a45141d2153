"""`orthoptim train --fsdp` / `--hsdp R,S` under a real torchrun launch (gloo, CPU): the same loss curves as
one process, checkpoints that resume under another layout; tied weights under the loop's FSDP2 wrapping;
one-line errors for layouts that cannot run.

Tolerance: fp32 throughout, and every optimizer used here is exact under FSDP (Dion3 with the CLI's
default global row selection), so the runs differ from one process only in reduction order (two
half-batch gradients reduce-scattered instead of one backward, norms summed over shards): about
2e-7 relative on these losses. rel 1e-4 leaves a wide margin for that, while a layout error (per-shard
row selection, a per-rank clipping norm, gradients not averaged) moves the losses or grad norms by
more than 1e-3.
"""

from __future__ import annotations

import json

import pytest
import torch

from orthoptim.cli import main
from tests.distributed_harness import launch_report, needs_cpu_hsdp, run_distributed, torchrun
from tests.test_cli_train import TINY

REL = 1e-4
# Dion3: rows exchanged over distributed_mesh; Dion: outer_shard_mesh; AdamW: torch's, on DTensor shards.
NAMES = ["dion3", "dion", "adamw"]
ARGS = [*TINY, "--quiet", "--no-plot", "--steps", "4", "--batch-size", "4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, every optimizer of the tests; also builds the corpus cache the launches share."""
    root = tmp_path_factory.mktemp("layouts")
    assert main(["train", *ARGS, "--cache-dir", str(root / "cache"), "--compare", ",".join(NAMES),
                 "--out", str(root / "one")]) == 0
    runs = json.loads((root / "one" / "results.json").read_text())["runs"]
    # Clipping (--clip 1.0) acts on every step, so a wrong (per-shard) norm would change the run.
    assert all(min(runs[n]["history"]["grad_norm"]) > 1.0 for n in NAMES)
    return root, runs


def _assert_same_curves(one: dict, other: dict, names: list[str]) -> None:
    for name in names:
        a, b = one[name]["history"], other[name]["history"]
        assert b["step"] == a["step"] and b["val_step"] == a["val_step"], name
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=REL), (name, key)


@pytest.mark.slow
@needs_cpu_hsdp
def test_fsdp_then_resume_under_hsdp_matches_one_process(reference):
    root, one = reference
    out = root / "fsdp"
    done = torchrun(2, "train", *ARGS, "--cache-dir", str(root / "cache"), "--compare", ",".join(NAMES),
                    "--fsdp", "--stop-at", "2", "--out", str(out))
    assert done.returncode == 0, launch_report(done)
    partial = json.loads((out / "results.json").read_text())
    assert partial["environment"]["parallel"] == "fsdp"
    assert all(r["steps"] == 2 and not r["finished"] for r in partial["runs"].values())

    # The FSDP checkpoints continue under HSDP (1 replica x 2 shards): another layout, same curve.
    done = torchrun(2, "train", "--resume", str(out), "--hsdp", "1,2", "--quiet", "--no-plot", "--threads", "1")
    assert done.returncode == 0, launch_report(done)
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["parallel"] == "hsdp 1x2" and results["environment"]["processes"] == 2
    assert all(r["finished"] for r in results["runs"].values())
    _assert_same_curves(one, results["runs"], NAMES)

    # Checkpoints hold whole tensors in the one-process format: final weights and state as one process has them.
    for name in ("dion3", "adamw"):
        a = torch.load(root / "one" / "checkpoints" / f"{name}.pt", weights_only=False)
        b = torch.load(out / "checkpoints" / f"{name}.pt", weights_only=False)
        assert a["model"].keys() == b["model"].keys()
        for key, value in a["model"].items():
            assert type(b["model"][key]) is torch.Tensor, key
            torch.testing.assert_close(b["model"][key], value, rtol=REL, atol=1e-6)
        assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
        for i, state in a["optimizer"]["state"].items():
            for key, value in state.items():
                assert b["optimizer"]["state"][i][key].shape == value.shape, (name, i, key)


@pytest.mark.slow
@needs_cpu_hsdp
def test_hsdp_2x2_on_four_processes_matches_one_process(reference):
    root, one = reference
    out = root / "hsdp22"
    done = torchrun(4, "train", *ARGS, "--cache-dir", str(root / "cache"), "--optimizer", "dion3",
                    "--hsdp", "2,2", "--out", str(out))
    assert done.returncode == 0, launch_report(done)
    results = json.loads((out / "results.json").read_text())
    assert results["environment"]["parallel"] == "hsdp 2x2" and results["environment"]["processes"] == 4
    _assert_same_curves(one, results["runs"], ["dion3"])


# ------------------------------------------------------------------------------------ tied weights
def _tied_gpt():
    from orthoptim.train.loop import TrainConfig
    from orthoptim.train.model import GPT

    cfg = TrainConfig(n_layer=2, n_head=2, d_model=16, context=8)
    torch.manual_seed(0)
    model = GPT(cfg.model_config(64))
    model.head.weight = model.tok_emb.weight  # the train command's GPT is untied; tie it here
    return model, cfg


def _tied_steps(model, optimizer, steps: range, rank: int = 0, world: int = 1) -> list[float]:
    """Mean loss of each step's 4 sequences (this rank's share of them, averaged over the ranks)."""
    import torch.distributed as dist

    losses = []
    for step in steps:
        tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(step))
        share = tokens[rank * 4 // world:(rank + 1) * 4 // world]
        _, loss = model(share[:, :-1], share[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 0.1)  # tight: clips every step
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def _tied_fsdp(rank: int, world: int, path: str) -> list[float]:
    import torch.distributed as dist

    from orthoptim.train.loop import build_optimizer, full_state, load_full_state, make_parallel, shard_model

    parallel = make_parallel("fsdp", torch.device("cpu"))
    model, cfg = _tied_gpt()
    shard_model(model, parallel)
    assert model.head.weight is model.tok_emb.weight  # still one parameter, now a DTensor
    optimizer = build_optimizer("dion3", model, cfg, parallel.shard_mesh)
    losses = _tied_steps(model, optimizer, range(2), rank, world)
    model_sd, optim_sd = full_state(model, optimizer, parallel)
    if rank == 0:
        torch.save({"model": model_sd, "optimizer": optim_sd}, path)
    dist.barrier()
    # A fresh sharded model and optimizer continue from the whole-tensor checkpoint.
    model, cfg = _tied_gpt()
    shard_model(model, parallel)
    optimizer = build_optimizer("dion3", model, cfg, parallel.shard_mesh)
    load_full_state(model, optimizer, torch.load(path, weights_only=False), parallel)
    return losses + _tied_steps(model, optimizer, range(2, 4), rank, world)


@pytest.mark.slow
def test_tied_embedding_under_fsdp_matches_one_process(tmp_path):
    from orthoptim.train.loop import build_optimizer

    model, cfg = _tied_gpt()
    optimizer = build_optimizer("dion3", model, cfg)
    one = _tied_steps(model, optimizer, range(4))
    path = str(tmp_path / "tied.pt")
    sharded = run_distributed(_tied_fsdp, 2, path, timeout=90)
    for losses in sharded:
        assert losses == pytest.approx(one, rel=REL)
    # The checkpoint written under FSDP loads into one process, tie included.
    model, cfg = _tied_gpt()
    optimizer = build_optimizer("dion3", model, cfg)
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    assert model.head.weight is model.tok_emb.weight


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(("world", "args", "message"), [
    (None, ["--fsdp"], "--fsdp needs several processes; launch with torchrun --standalone --nproc_per_node N "
                       "-m orthoptim.cli train --fsdp ... (WORLD_SIZE is unset)"),
    ("1", ["--hsdp", "1,1"], "--hsdp 1,1 needs several processes"),
    (None, ["--ddp"], "--ddp needs several processes"),
    ("2", ["--hsdp", "3,1"], "--hsdp 3,1 needs 3x1 = 3 processes but torchrun started 2; choose R,S with "
                             "R*S = 2, e.g. --hsdp 1,2"),
    ("4", ["--hsdp", "1,2"], "choose R,S with R*S = 4, e.g. --hsdp 2,2"),
    (None, ["--fsdp", "--hsdp", "1,2"], "argument --hsdp: not allowed with argument --fsdp"),
    (None, ["--hsdp", "2"], "give R,S"),
    (None, ["--hsdp", "2,0"], "must be a positive integer"),
])
def test_layout_errors_are_one_line(tmp_path, capsys, monkeypatch, world, args, message):
    """Refused in-process before any process group, data or output folder is made."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["train", *ARGS, "--cache-dir", str(tmp_path / "cache"), *args,
                               "--out", str(tmp_path / "run")]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
