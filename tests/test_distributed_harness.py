"""The torchrun helper of the tests: which failed launches it relaunches, and what it reports."""

from __future__ import annotations

import subprocess

import pytest

from tests import distributed_harness as harness

# The shape of torchrun's summary when rank 1 crashed and the launcher then stopped rank 0.
WORKER_OUTPUT = "Fatal Python error: Aborted\n\nThread 0x01 (most recent call first):\n  File \"loop.py\", line 9\n"
SUMMARY = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 25109)  (SIGTERM)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 25110)
=======================================================
"""


def _done(code: int, stderr: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["torchrun"], code, "", stderr)


def _crash(code: str = "-6") -> subprocess.CompletedProcess:
    return _done(1, WORKER_OUTPUT + SUMMARY.format(code=code))


def test_signal_from_worker_reads_the_summary():
    assert harness._signal_from_worker(SUMMARY.format(code="-6")) == "SIGABRT"
    assert harness._signal_from_worker(SUMMARY.format(code="-11")) == "SIGSEGV"
    assert harness._signal_from_worker(SUMMARY.format(code="1")) is None  # a Python error
    assert harness._signal_from_worker(SUMMARY.format(code="-15")) is None  # only the launcher's SIGTERM
    assert harness._signal_from_worker("") is None
    assert harness._signal_from_worker(SUMMARY.format(code="-99")) == "signal 99"  # no name on this system


def test_launch_report_keeps_the_workers_output_and_the_root_cause():
    filler = "x" * 5000  # launcher noise after the workers' output would crowd it out of a plain tail
    report = harness.launch_report(_done(1, WORKER_OUTPUT + SUMMARY.format(code="-6") + filler))
    assert "Fatal Python error: Aborted" in report and "Root Cause" in report
    assert "exitcode  : -6" in report and "_run_module_as_main" not in report
    assert harness.launch_report(_done(1, "plain error\n")) == "plain error\n"


def _fake_launches(monkeypatch, *results):
    calls = []

    def launch(nproc, args, timeout):
        calls.append(args)
        return results[len(calls) - 1]

    monkeypatch.setattr(harness, "_launch", launch)
    return calls


def test_a_native_crash_is_relaunched_once_with_a_warning(monkeypatch, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a fresh run's partial output would refuse the relaunch
    calls = _fake_launches(monkeypatch, _crash(), _done(0))
    with pytest.warns(UserWarning, match=r"(?s)SIGABRT; relaunching once.*Fatal Python error"):
        done = harness.torchrun(2, "train", "--out", str(out))
    assert done.returncode == 0 and len(calls) == 2 and not out.exists()


def test_a_second_crash_reaches_the_test(monkeypatch):
    calls = _fake_launches(monkeypatch, _crash(), _crash("-11"))
    with pytest.warns(UserWarning):
        done = harness.torchrun(2, "train", "--resume", "somewhere")
    assert done.returncode == 1 and len(calls) == 2
    assert harness._signal_from_worker(done.stderr) == "SIGSEGV"


def test_a_python_error_is_not_relaunched(monkeypatch):
    calls = _fake_launches(monkeypatch, _crash(code="1"))
    assert harness.torchrun(2, "train").returncode == 1 and len(calls) == 1
