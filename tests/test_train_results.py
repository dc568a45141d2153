"""Result and checkpoint files: written whole or not at all."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from orthoptim.train import results


class _Unsaveable:
    def __reduce__(self):
        raise RuntimeError("this object cannot be saved")  # fails midway through writing the file


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_checkpoint_is_flushed_to_disk_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    real_replace = os.replace

    def replace(src, dst):
        assert synced, "renamed before the data reached the disk"
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    results.save_torch(tmp_path / "model.pt", {"w": torch.arange(3)})
    assert torch.equal(torch.load(tmp_path / "model.pt", weights_only=True)["w"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    results.save_torch(tmp_path / "model.pt", {"step": 1})
    with pytest.raises(RuntimeError, match="cannot be saved"):
        results.save_torch(tmp_path / "model.pt", {"step": _Unsaveable()})
    assert torch.load(tmp_path / "model.pt", weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_temporaries_a_killed_process_left_are_removed(tmp_path):
    dead = tmp_path / f".model.pt.{_dead_pid()}.tmp"
    alive = tmp_path / f".model.pt.{os.getppid()}.tmp"  # a running process's write in progress
    other = tmp_path / ".other.pt.1.tmp"
    for path in (dead, alive, other):
        path.write_bytes(b"partial")
    results.save_torch(tmp_path / "model.pt", {"step": 3})
    assert not dead.exists() and alive.exists() and other.exists()
