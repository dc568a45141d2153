"""The `orthoptim` command: `orthoptim train` (train and compare optimizers on a small GPT) and
`orthoptim bench` (optimizer step time and orthogonalization accuracy on GPT-shaped matrices)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from orthoptim import __version__


class UsageError(Exception):
    """An invalid option or combination of options; reported as one line, exit status 2."""


class CommandError(Exception):
    """The command could not do its job (bad data, a diverged run…); one line, exit status 1."""


def check_out_dir(path: Path, create: bool = False) -> None:
    """Refuse an output folder ``--out`` that cannot be one, before any work; ``create``: make it now."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--out {path} is a file, not a folder; pass a folder to write the results into")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: cannot create a folder under {existing}; pass another --out")
    if create:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--out {path}: cannot create this folder ({e.strerror or e}); pass another --out") \
                from None


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be an integer >= 0")
    return value


def seed_int(text: str) -> int:
    """argparse type: a seed torch.manual_seed takes (0 <= seed < 2**63)."""
    value = non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"{text} is too large; use a seed below 2**63")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, but every error is one line (the usage is one --help away)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except where the help already says it, for flags, and for None (nothing set)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


def build_parser() -> Parser:
    from orthoptim.cli import bench, train

    parser = Parser(prog="orthoptim", formatter_class=HelpFormatter,
                    description="Train, compare and benchmark orthonormal optimizers (Dion3, Dion, Dion2, Muon, "
                                "NorMuon) against AdamW.",
                    epilog="Run `orthoptim train --help` or `orthoptim bench --help` for each command's options.")
    parser.add_argument("--version", action="version", version=f"orthoptim {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{train,bench}", parser_class=Parser)
    train.add_parser(commands)
    bench.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    prog = f"orthoptim {args.command}"
    try:
        return args.run(args)
    except UsageError as e:
        print(f"{prog}: error: {e} (see {prog} --help)", file=sys.stderr)
        return 2
    except CommandError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130


def console() -> None:
    """The `orthoptim` program (the console script and ``python -m orthoptim.cli``): ``main`` with the
    command line, exiting with its status.

    Under torchrun (WORLD_SIZE > 1) the process then ends without the interpreter's teardown, once
    the output is flushed. By then the run's files are written and the process group is destroyed,
    but a native thread of torch's distributed runtime can still be joinable while C++ destructors
    run, and that aborts the process (SIGABRT, "terminate called without an active exception")
    after a run that succeeded.
    """
    try:
        code = main()
    except SystemExit as e:  # --help, --version, argparse's errors
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # reported as the interpreter would, exit status 1
        traceback.print_exc()
        code = 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
