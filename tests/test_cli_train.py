"""`orthoptim train` end to end on a tiny configuration: files, resume, errors, --help."""

from __future__ import annotations

import json
import math

import pytest
import torch

from orthoptim.cli import main
from tests.distributed_harness import launch_report, torchrun

TINY = ["--n-layer", "1", "--n-head", "2", "--d-model", "16", "--context", "16", "--batch-size", "2",
        "--eval-every", "2", "--eval-batches", "1", "--corpus-mb", "0.1", "--threads", "1"]


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _train(tmp_path, *args: str) -> int:
    return main(["train", *TINY, "--cache-dir", str(tmp_path / "cache"), "--quiet", *args])


def test_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tmp_path, "--compare", "dion3,muon,adamw", "--steps", "4", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    for name in ("dion3", "muon", "adamw"):
        assert name in printed
    for column in ("val loss", "bits/byte", "tokens/s", "opt ms/step", "opt share", "peak MB"):
        assert column in printed
    results = json.loads((out / "results.json").read_text())
    assert list(results["runs"]) == ["dion3", "muon", "adamw"]
    for run in results["runs"].values():
        assert run["finished"] and run["steps"] == 4
        assert math.isclose(run["final_val_bpb"], run["final_val_loss"] / math.log(2))
        assert run["history"]["val_step"] == [0, 2, 4]
        assert len(run["history"]["train_loss"]) == 4
        assert 0 < run["opt_share"] < 1
    # same seed → same initial weights → the same loss before any step, for every optimizer
    first = {r["history"]["val_loss"][0] for r in results["runs"].values()}
    assert len(first) == 1
    assert (out / "loss.png").stat().st_size > 10_000
    assert (out / "summary.txt").read_text().startswith("optimizer")
    config = json.loads((out / "config.json").read_text())
    assert config["command"].startswith("orthoptim train --compare dion3,muon,adamw")
    assert "--lr dion3=" in config["command"] and config["config"]["steps"] == 4
    assert not list(out.glob(".*tmp*"))  # no temporary files left behind


def test_resume_equals_uninterrupted(tmp_path):
    names = "dion3,dion,adamw"
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _train(tmp_path, "--compare", names, "--steps", "6", "--out", str(whole), "--no-plot") == 0
    assert _train(tmp_path, "--compare", names, "--steps", "6", "--out", str(split), "--no-plot",
                  "--stop-at", "3") == 0
    partial = json.loads((split / "results.json").read_text())
    assert all(not r["finished"] and r["steps"] == 3 for r in partial["runs"].values())
    assert main(["train", "--resume", str(split), "--quiet", "--no-plot", "--threads", "1"]) == 0
    a = json.loads((whole / "results.json").read_text())["runs"]
    b = json.loads((split / "results.json").read_text())["runs"]
    for name in names.split(","):
        assert b[name]["finished"]
        for key in ("step", "train_loss", "val_step", "val_loss", "grad_norm", "lr"):
            assert a[name]["history"][key] == b[name]["history"][key], (name, key)
    ckpt_a = torch.load(whole / "checkpoints" / "dion3.pt", weights_only=False)
    ckpt_b = torch.load(split / "checkpoints" / "dion3.pt", weights_only=False)
    for key, value in ckpt_a["model"].items():
        assert torch.equal(value, ckpt_b["model"][key]), key


def test_resuming_on_another_kind_of_device_keeps_the_autocast_the_run_had(tmp_path):
    """--autocast auto is bf16 on CUDA, off on CPU: a run moved by --resume --device to another kind
    of device would have switched precision half-way. (A CUDA run is faked by its config here.)"""
    out = tmp_path / "run"
    assert _train(tmp_path, "--optimizer", "adamw", "--steps", "4", "--stop-at", "2", "--no-plot",
                  "--out", str(out)) == 0
    config_file = out / "config.json"
    header = json.loads(config_file.read_text())
    assert header["config"]["autocast"] == "auto"
    header["config"]["device"] = "cuda"  # as if it had started on a GPU: its config and its checkpoint
    config_file.write_text(json.dumps(header))
    checkpoint = out / "checkpoints" / "adamw.pt"
    saved = torch.load(checkpoint, weights_only=False)
    saved["config"]["device"] = "cuda"
    torch.save(saved, checkpoint)
    assert main(["train", "--resume", str(out), "--device", "cpu", "--quiet", "--no-plot"]) == 0
    resumed = json.loads(config_file.read_text())["config"]
    assert resumed["device"] == "cpu" and resumed["autocast"] == "bf16"


@pytest.mark.parametrize(("args", "message"), [
    (["--optimizer", "sgd"], "unknown optimizer(s) sgd"),
    (["--compare", "dion3,dion3"], "names an optimizer twice"),
    (["--optimizer", "dion3,muon"], "use --compare for several"),
    (["--optimizer", "muon", "--compare", "muon,adamw"], "not allowed with argument"),
    (["--d-model", "30", "--n-head", "4"], "--d-model 30 is not a multiple of --n-head 4"),
    (["--steps", "0"], "must be a positive integer"),
    (["--fraction", "1.5"], "--fraction 1.5 must be in (0, 1]"),
    (["--lr", "muon=0.01"], "--lr names muon, which this run does not train"),
    (["--lr", "sgd=0.1"], "unknown optimizer 'sgd'"),
    (["--scalar-lr", "0"], "the learning rate must be > 0"),  # as --lr 0 (it froze embeddings, head, norms)
    (["--stop-at", "50", "--steps", "10"], "--stop-at 50 must be smaller than --steps 10"),
    (["--warmup", "0.6", "--cooldown", "0.6"], "exceeds 1"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_invalid_options_fail_with_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        code = _train(tmp_path, *args)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bad_data_fails_with_one_line(tmp_path, capsys):
    assert _train(tmp_path, "--data", str(tmp_path / "missing.txt")) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"orthoptim train: error: --data {tmp_path / 'missing.txt'}: no such file or folder"


def test_diverging_run_fails_with_this_commands_advice(tmp_path, capsys):
    """The library's error names its own option (nonfinite='skip'), which this command does not have."""
    assert _train(tmp_path, "--optimizer", "dion3", "--steps", "3", "--lr", "1e30", "--scalar-lr", "1e30",
                  "--no-plot", "--out", str(tmp_path / "run")) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("orthoptim train: error: dion3: parameter ") and "non-finite gradient" in err, err
    assert err.endswith("Lower --lr or --scalar-lr") and "nonfinite" not in err, err  # --clip is on (1.0)
    assert _train(tmp_path, "--optimizer", "dion3", "--steps", "3", "--lr", "1e30", "--scalar-lr", "1e30",
                  "--clip", "0", "--no-plot", "--out", str(tmp_path / "unclipped")) == 1
    assert capsys.readouterr().err.strip().endswith("Lower --lr or --scalar-lr, or set --clip")


def test_an_interrupt_before_training_starts_does_not_offer_a_resume(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the data is read or built: no config.json yet, so --resume would fail."""
    from orthoptim.cli import train as train_command

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "load_dataset", interrupted)
    assert _train(tmp_path, "--optimizer", "adamw", "--no-plot", "--out", str(tmp_path / "run")) == 130
    err = capsys.readouterr().err
    assert "interrupted before training started; nothing to resume" in err and "--resume" not in err, err


def test_resume_refuses_changes(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tmp_path, "--steps", "2", "--out", str(out), "--no-plot") == 0
    assert main(["train", "--resume", str(out), "--lr", "0.5"]) == 2
    assert "drop --lr" in capsys.readouterr().err
    assert _train(tmp_path, "--steps", "2", "--out", str(out)) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 1


def test_resume_refuses_another_optimizers_checkpoint_and_another_cpu_iteration_dtype(tmp_path, capsys,
                                                                                       monkeypatch):
    """A muon checkpoint copied over dion3's resumed with a warning and was reported as dion3's; a run
    moved to a CPU whose polar iterations run in another dtype continued with other numbers."""
    out = tmp_path / "run"
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    assert _train(tmp_path, "--compare", "dion3,muon", "--steps", "4", "--stop-at", "2", "--out", str(out),
                  "--no-plot") == 0
    capsys.readouterr()
    checkpoints = out / "checkpoints"
    own = (checkpoints / "dion3.pt").read_bytes()
    (checkpoints / "dion3.pt").write_bytes((checkpoints / "muon.pt").read_bytes())
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "dion3.pt holds a checkpoint of 'muon', not of 'dion3'" in capsys.readouterr().err
    (checkpoints / "dion3.pt").write_bytes(own)
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "bfloat16")
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "ORTHOPTIM_CPU_DTYPE=float32 to continue as it ran" in capsys.readouterr().err
    monkeypatch.setenv("ORTHOPTIM_CPU_DTYPE", "float32")
    # resumed on "another machine": the record keeps the first job's environment, which differs
    import orthoptim.cli.train as cli_train
    first = json.loads((out / "config.json").read_text())["environment"]
    monkeypatch.setattr(cli_train, "environment", lambda device: {**first, "platform": "elsewhere"})
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 0
    record = json.loads((out / "results.json").read_text())
    assert record["environment"]["platform"] == "elsewhere" and record["earlier_environments"] == [first]


def test_resume_refuses_other_data_an_edited_config_and_unreadable_files(tmp_path, capsys):
    """Each of these used to resume (on the new data, or under the edited lr, recorded as if it had
    held from the start) or end in a traceback."""
    text = tmp_path / "a.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "run"
    assert _train(tmp_path, "--optimizer", "muon", "--data", str(text), "--steps", "4", "--stop-at", "2",
                  "--out", str(out), "--no-plot") == 0
    capsys.readouterr()
    config_file = out / "config.json"
    header = json.loads(config_file.read_text())
    assert len(header["data_sha256"]) == 64

    text.write_text("pack my box with five dozen liquor jugs. " * 200)
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "not the data this run trained on" in capsys.readouterr().err
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)

    edited = json.loads(config_file.read_text())
    edited["config"]["lr"]["muon"] = 0.5
    config_file.write_text(json.dumps(edited))
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "muon.pt was trained with another configuration" in err and "0.5" in err, err
    config_file.write_text(json.dumps(header))

    checkpoint = out / "checkpoints" / "muon.pt"
    good = checkpoint.read_bytes()
    checkpoint.write_bytes(good[: len(good) // 2])
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "muon.pt cannot be read" in capsys.readouterr().err
    torch.save(torch.zeros(3), checkpoint)  # readable, but not a checkpoint
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "muon.pt is not a checkpoint of orthoptim train" in capsys.readouterr().err
    checkpoint.write_bytes(good)

    config_file.write_text("{not json")
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 1
    assert "config.json cannot be read" in capsys.readouterr().err
    config_file.write_text(json.dumps(header))
    assert main(["train", "--resume", str(out), "--no-plot", "--quiet"]) == 0  # as it was: it continues


def test_vocab_size_is_checked_against_the_largest_token_not_the_rounded_default(tmp_path, capsys):
    from orthoptim.train import data

    shard = tmp_path / "tokens.bin"
    data.write_shard(shard, torch.arange(300).repeat(4))  # ids 0..299: the default vocabulary is 320
    args = ["--optimizer", "adamw", "--data", str(shard), "--steps", "1", "--no-plot"]
    assert _train(tmp_path, *args, "--vocab-size", "300", "--out", str(tmp_path / "a")) == 0
    # The description saved with the run gives the vocabulary it trained with, not the one read.
    described = json.loads((tmp_path / "a" / "config.json").read_text())["data"]
    assert described.endswith("vocabulary 300 (--vocab-size)") and "320" not in described, described
    assert _train(tmp_path, *args, "--vocab-size", "299", "--out", str(tmp_path / "b")) == 2
    assert "does not hold the data's token 299; give at least 300" in capsys.readouterr().err


def test_one_lr_leaves_the_adamw_groups_alone_whatever_the_comparison(tmp_path, capsys):
    """--lr 0.01 gave Dion3's embeddings, head and norms lr 0.01 when adamw was in --compare and 0.004
    when it was not: the same Dion3 settings trained differently next to another optimizer."""
    from orthoptim.cli.train import resolve_config

    with_adamw = resolve_config({"optimizers": ["dion3", "adamw"], "lr": 0.01})
    without = resolve_config({"optimizers": ["dion3", "muon"], "lr": 0.01})
    assert with_adamw.scalar_lr == without.scalar_lr == 0.004 and with_adamw.lr_for("adamw") == 0.01
    named = resolve_config({"optimizers": ["dion3", "adamw"], "lr": {"adamw": 0.002}})
    assert named.scalar_lr == 0.002  # adamw's lr given by name still sets them
    assert resolve_config({"optimizers": ["dion3"], "lr": 0.01, "scalar_lr": 0.001}).scalar_lr == 0.001
    # adamw alone has no such groups: nothing saved, so its reproduce command runs (no --scalar-lr)
    assert resolve_config({"optimizers": ["adamw"], "lr": 0.01}).scalar_lr is None
    assert _train(tmp_path, "--optimizer", "adamw", "--scalar-lr", "0.001") == 2  # nothing would read it
    assert "trains only adamw" in capsys.readouterr().err


def test_reproduce_command_keeps_every_digit_of_the_lr(tmp_path):
    out = tmp_path / "run"
    assert _train(tmp_path, "--optimizer", "muon", "--lr", "0.0123456789", "--steps", "1", "--out", str(out),
                  "--no-plot") == 0
    assert "--lr muon=0.0123456789 " in json.loads((out / "config.json").read_text())["command"]


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--optimizer", "--compare", "--data", "--cache-dir", "--steps", "--lr", "--clip", "--resume",
                   "--stop-at", "--device", "--preset", "--positions", "--fraction", "--threads", "--ddp", "--fsdp",
                   "--hsdp", "--selection-scope", "torchrun --standalone --nproc_per_node"):
        assert option in text
    assert "(default: 600)" in text  # defaults are spelled out


@pytest.mark.slow
def test_torchrun_two_processes_match_one(tmp_path):
    """Under torchrun each rank takes its share of the same global batch: same losses as one process."""
    args = ["train", *TINY, "--cache-dir", str(tmp_path / "cache"), "--quiet", "--no-plot", "--steps", "3",
            "--batch-size", "4", "--compare", "dion3,dion,adamw"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    done = torchrun(2, *args, "--out", str(tmp_path / "two"))
    assert done.returncode == 0, launch_report(done)
    one = json.loads((tmp_path / "one" / "results.json").read_text())["runs"]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["environment"]["processes"] == 2
    assert two["environment"]["parallel"] == "ddp"  # the default under torchrun
    for name in ("dion3", "dion", "adamw"):  # Dion: each rank computes a share of the factors
        a, b = one[name]["history"], two["runs"][name]["history"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)


@pytest.mark.parametrize("fails", [False, True])
def test_ranks_meet_at_a_barrier_before_tearing_down(tmp_path, monkeypatch, fails):
    """Under torchrun a finished run waits for every rank before closing the process group; a run
    that failed goes straight to the teardown (the other ranks may never reach a barrier)."""
    from orthoptim.cli import train as train_cli

    calls = []

    def compare(*args, **kwargs):
        calls.append("compare")
        if fails:
            raise RuntimeError("a rank failed")

    monkeypatch.setattr(train_cli, "start_distributed", lambda *a: (0, None))
    monkeypatch.setattr(train_cli, "compare", compare)
    monkeypatch.setattr(train_cli.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(train_cli.dist, "barrier", lambda: calls.append("barrier"))
    monkeypatch.setattr(train_cli.dist, "destroy_process_group", lambda: calls.append("destroy"))
    if fails:
        with pytest.raises(RuntimeError, match="a rank failed"):
            _train(tmp_path, "--out", str(tmp_path / "run"))
        assert calls == ["compare", "destroy"]
    else:
        assert _train(tmp_path, "--out", str(tmp_path / "run")) == 0
        assert calls == ["compare", "barrier", "destroy"]


def test_train_on_bin_shards(tmp_path, capsys):
    from orthoptim.train.data import write_shard

    gen = torch.Generator().manual_seed(0)
    (tmp_path / "shards").mkdir()
    write_shard(tmp_path / "shards" / "toy_train_000001.bin", torch.randint(0, 1000, (3000,), generator=gen))
    write_shard(tmp_path / "shards" / "toy_val_000000.bin", torch.randint(0, 1000, (500,), generator=gen))
    out = tmp_path / "run"
    assert _train(tmp_path, "--data", str(tmp_path / "shards"), "--steps", "2", "--out", str(out), "--no-plot") == 0
    run = json.loads((out / "results.json").read_text())["runs"]["dion3"]
    assert run["final_val_bpb"] is None  # bytes per token unknown for pre-tokenized data
    assert "1 train / 1 val shard(s), vocabulary 1024" in json.loads((out / "config.json").read_text())["data"]
    assert capsys.readouterr().out.splitlines()[2].split()[3] == "-"  # the bits/byte cell


def test_hsdp_on_cpu_is_refused_before_torch_2_8(monkeypatch):
    """torch 2.7's FSDP2 cannot average HSDP replicas over gloo: refused by name before any process
    group is joined (the same call on torch >= 2.8 would go on to init_process_group)."""
    from torch.torch_version import TorchVersion

    from orthoptim.cli import UsageError
    from orthoptim.cli import train as train_cli

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(train_cli.torch, "__version__", TorchVersion("2.7.1+cpu"))
    monkeypatch.setattr(train_cli.dist, "init_process_group", lambda *a, **k: pytest.fail("joined a process group"))
    cfg = train_cli.TrainConfig(batch_size=4)
    with pytest.raises(UsageError, match=r"--hsdp 2,2 on CPU needs torch >= 2.8 \(this is 2.7.1\+cpu\)"):
        train_cli.start_distributed(cfg, "hsdp", (2, 2))


def test_a_token_beyond_the_vocabulary_in_a_later_shard_is_a_one_line_error(tmp_path, capsys):
    from orthoptim.train import data

    shards = tmp_path / "shards"
    shards.mkdir()
    data.write_shard(shards / "a_train_000.bin", torch.arange(400) % 50)
    data.write_shard(shards / "b_train_001.bin", torch.full((400,), 1000))
    data.write_shard(shards / "c_val_000.bin", torch.arange(400) % 50)
    code = _train(tmp_path, "--optimizer", "adamw", "--steps", "20", "--data", str(shards), "--no-plot",
                  "--out", str(tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err and "--vocab-size" in err, err


@pytest.mark.parametrize("command", ["train", "bench"])
def test_an_out_that_is_a_file_is_refused_before_any_work(tmp_path, capsys, command):
    target = tmp_path / "results.txt"
    target.write_text("not a folder")
    if command == "train":
        code = _train(tmp_path, "--optimizer", "adamw", "--steps", "2", "--out", str(target))
    else:
        code = main(["bench", "--d-model", "16", "--layers", "1", "--warmup", "0", "--repeats", "1",
                     "--optimizers", "adamw", "--quiet", "--out", str(target)])
    err = capsys.readouterr().err
    assert code == 2 and f"--out {target} is a file" in err, err
    assert target.read_text() == "not a folder"


@pytest.mark.parametrize("command", ["train", "bench"])
def test_a_seed_beyond_torchs_range_is_a_usage_error(tmp_path, capsys, command):
    with pytest.raises(SystemExit) as info:  # argparse's own exit for a bad value
        if command == "train":
            _train(tmp_path, "--optimizer", "adamw", "--steps", "2", "--seed", str(2**70), "--out", str(tmp_path / "r"))
        else:
            main(["bench", "--d-model", "8", "--layers", "1", "--seed", str(2**70), "--out", str(tmp_path / "r")])
    assert info.value.code == 2 and "--seed" in (err := capsys.readouterr().err) and "below 2**63" in err
    assert not (tmp_path / "r").exists()


def test_flags_that_take_zero_say_so(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _train(tmp_path, "--save-every", "-1")
    assert "--save-every: -1 must be an integer >= 0" in capsys.readouterr().err


def test_a_stopped_run_says_which_step_its_val_loss_is_from(tmp_path, capsys):
    assert _train(tmp_path, "--optimizer", "adamw", "--steps", "6", "--stop-at", "3", "--no-plot",
                  "--out", str(tmp_path / "run")) == 0
    assert "val loss is that of the last evaluation (adamw evaluated at step 2, stopped at 3)" in \
        capsys.readouterr().out


@pytest.mark.parametrize("clip", ["0", "1.0"])
def test_the_logged_grad_norm_is_the_whole_gradients_for_every_optimizer(tmp_path, clip):
    """Same init, same first batch: the same gradient, whatever the optimizer and whatever --clip
    clips (only the Adam-type parameters); it used to be the clipped parameters' norm, or 0 without --clip."""
    out = tmp_path / "run"
    assert _train(tmp_path, "--compare", "dion3,adamw", "--steps", "1", "--clip", clip, "--no-plot",
                  "--out", str(out)) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    first = [runs[name]["history"]["grad_norm"][0] for name in ("dion3", "adamw")]
    assert first[0] == first[1] > 0


def test_data_and_cache_paths_are_saved_absolute(tmp_path, monkeypatch):
    """A relative --data resumes, and its reproduce command runs, from any working folder."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.txt").write_text("a relative path to a small text file. " * 300)
    monkeypatch.chdir(work)
    assert main(["train", *TINY, "--cache-dir", "cache", "--quiet", "--no-plot", "--optimizer", "adamw",
                 "--data", "t.txt", "--steps", "4", "--stop-at", "2", "--out", "run"]) == 0
    config = json.loads((work / "run" / "config.json").read_text())["config"]
    assert config["data"] == str(work / "t.txt") and config["cache_dir"] == str(work / "cache")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(work / "run"), "--quiet", "--no-plot", "--threads", "1"]) == 0
    assert json.loads((work / "run" / "results.json").read_text())["runs"]["adamw"]["finished"]


def test_medians_leave_out_the_cold_first_step_of_a_resumed_job():
    from orthoptim.train.loop import _warm_median

    assert _warm_median([50.0, 2.0, 2.0, 40.0], resumed_at=3, step=4) == 2.0  # steps 1 and 4 start a process
    assert _warm_median([], resumed_at=0, step=0) != _warm_median([], resumed_at=0, step=0)  # nan


def test_a_resume_stopped_below_the_step_reached_names_the_step_reached(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tmp_path, "--optimizer", "adamw", "--steps", "6", "--stop-at", "4", "--out", str(out),
                  "--no-plot") == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--stop-at", "2", "--no-plot", "--quiet"]) == 0
    assert "stopped at step 4;" in capsys.readouterr().out
