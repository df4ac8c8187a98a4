"""The ``ddpckpt`` command line: the parser, the list of subcommands, exit statuses.

Each subcommand is a :class:`~ddpckpt._cli.command.Command` in a module of its own group
(``checkpoint_cmds``: inspect, verify, export, import; ``rundir_cmds``: ls, clean;
``diff_cmd``; ``demo_cmd``; ``bench_cmd``); ``COMMANDS`` lists them in help order.

Exit status (the same for every command, see ``_EXIT_STATUS``): 0 when it did its job and
found nothing wrong; 1 when it did its job and found problems or differences (``verify``,
``ls``: a corrupt or incomplete checkpoint; ``diff``: the checkpoints differ; ``demo``,
``check-resume``: the resume was not exact); 2 when it cannot do its job (a wrong or missing input, an unreadable
or corrupt input to ``inspect``/``export``/``diff``, a script that failed or damaged records
for ``check-resume``, a missing optional dependency, a refused pickle, a run directory locked
by a live job). A closed output pipe (``| head``) ends it
quietly with status 141, as it does other Unix tools.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from collections.abc import Sequence

from ddpckpt._cli import (
    bench_cmd,
    check_resume_cmd,
    checkpoint_cmds,
    demo_cmd,
    diff_cmd,
    rundir_cmds,
)
from ddpckpt._cli.command import CannotRun, Command
from ddpckpt._version import __version__
from ddpckpt.errors import CheckpointError

COMMANDS: tuple[Command, ...] = (
    demo_cmd.DEMO,
    check_resume_cmd.CHECK_RESUME,
    rundir_cmds.LS,
    rundir_cmds.CLEAN,
    checkpoint_cmds.INSPECT,
    checkpoint_cmds.VERIFY,
    diff_cmd.DIFF,
    checkpoint_cmds.EXPORT,
    checkpoint_cmds.IMPORT,
    bench_cmd.BENCH,
)

_EXIT_STATUS = """exit status:
  0  done, nothing wrong found
  1  done, and found problems or differences (verify, ls: a bad checkpoint; diff: they
     differ; demo, check-resume: the resume was not exact)
  2  cannot do its job (wrong or missing input, corrupt input to inspect/export/diff,
     a failed script or damaged records for check-resume, missing optional dependency,
     run locked by a live job)
  141  the output pipe was closed early (`| head`); nothing is printed about it"""
_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a tool killed by the signal reports


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpckpt",
        description=textwrap.fill(
            "Checkpoints for PyTorch DDP training: prove a script resumes exactly (demo, "
            "check-resume), look after a run directory (ls, clean), and inspect, verify, "
            "compare, export and import checkpoints. 'ddpckpt COMMAND --help' explains each.",
            width=88,
        ),
        epilog=_EXIT_STATUS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ddpckpt {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        sub = commands.add_parser(command.name, help=command.help, description=command.description)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see ``_EXIT_STATUS``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `ddpckpt`: what it can do
        parser.print_help()
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        status = int(args.run(args))
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # so the flush at exit cannot fail again
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return _BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"ddpckpt {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CannotRun, CheckpointError, OSError, ValueError, RuntimeError, ImportError) as exc:
        print(f"ddpckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
