"""What a ``ddpckpt`` subcommand is: a name, its arguments and the function that runs it.

A command module defines one :class:`Command` per subcommand; ``cli/main.py`` lists them
in ``COMMANDS``, in the order ``ddpckpt --help`` shows them. Adding a subcommand is a new
module with a ``Command`` and one line in that list.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


class CannotRun(Exception):
    """The command cannot do its job; the message says why, in command-line terms (exit 2)."""


@dataclass(frozen=True)
class Command:
    """One subcommand. ``help`` is its line in ``ddpckpt --help``, ``description`` the
    paragraph of ``ddpckpt NAME --help``; every argument ``add_arguments`` adds has a help
    text. ``run`` gets the parsed arguments and returns the exit status."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str
