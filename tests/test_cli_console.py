"""The `orthoptim` program's exit: the status of ``main``, and under torchrun an exit that skips the
interpreter's teardown (where a native thread of torch's distributed runtime can abort the process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orthoptim import cli


class Exited(Exception):
    """Raised by the stand-in for os._exit, so the test sees the status it was given."""


def _run_console(monkeypatch, world_size, outcome):
    def fake_main():
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(cli, "main", fake_main)
    monkeypatch.setattr(cli.os, "_exit", fake_exit)
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    with pytest.raises((SystemExit, Exited)) as ended:
        cli.console()
    return ended.value


@pytest.mark.parametrize(("outcome", "code"), [(0, 0), (2, 2), (SystemExit(2), 2), (SystemExit(None), 0),
                                               (SystemExit("bad"), 1), (KeyboardInterrupt(), 130),
                                               (RuntimeError("boom"), 1)])
def test_under_torchrun_the_process_ends_with_mains_status_and_no_teardown(monkeypatch, capsys, outcome, code):
    ended = _run_console(monkeypatch, "2", outcome)
    assert isinstance(ended, Exited) and ended.args == (code,)
    if isinstance(outcome, RuntimeError):
        assert "RuntimeError: boom" in capsys.readouterr().err  # the traceback is still printed


@pytest.mark.parametrize("world_size", [None, "1"])
def test_one_process_exits_normally(monkeypatch, world_size):
    ended = _run_console(monkeypatch, world_size, 3)
    assert isinstance(ended, SystemExit) and ended.code == 3


def test_output_written_before_the_exit_is_flushed(tmp_path):
    """Output still in Python's buffers when os._exit runs would be lost: it reaches a pipe."""
    code = ("import os, sys; from orthoptim import cli; os.environ['WORLD_SIZE'] = '2'; "
            "cli.main = lambda: print('from main', end='') or sys.stderr.write('to stderr') and 4; cli.console()")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as by default
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (4, "from main", "to stderr")


@pytest.mark.parametrize("module", ["orthoptim", "orthoptim.cli"])
def test_python_dash_m_runs_the_program_and_importing_its_main_does_not(module):
    done = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("orthoptim ")
    code = f"import sys; sys.argv = ['x', '--version']; import {module}.__main__; print('imported')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (0, "imported\n"), done.stderr
