"""A Sphinx directive that writes the command-line reference from ddpckpt's own parser.

``.. ddpckpt-cli::`` (in MyST: a ``{ddpckpt-cli}`` directive) becomes the top-level help and
one section per subcommand, in ``ddpckpt --help`` order, holding that subcommand's whole
``--help`` text, so the reference cannot drift from the installed command.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive


class CliReference(Directive):
    has_content = False

    def run(self) -> list[nodes.Node]:
        from ddpckpt._cli.main import COMMANDS, _parser

        os.environ["COLUMNS"] = "88"  # argparse wraps to the terminal: fix the width
        parser = _parser()
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        out: list[nodes.Node] = [
            nodes.literal_block(text=parser.format_help().rstrip(), language="text")
        ]
        for command in COMMANDS:
            section = nodes.section(ids=[f"ddpckpt-{command.name}"])
            section += nodes.title(text=f"ddpckpt {command.name}")
            section += nodes.paragraph(text=command.help[:1].upper() + command.help[1:] + ".")
            help_text = subparsers.choices[command.name].format_help().rstrip()
            section += nodes.literal_block(text=help_text, language="text")
            out.append(section)
        return out


def setup(app: Any) -> dict[str, Any]:
    app.add_directive("ddpckpt-cli", CliReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
