"""The ``kvrouter`` command.

Each command group lives beside the code it drives and adds its own sub-parser through a
``register(subparsers)`` function; this module only assembles them and configures logging
(libraries never configure handlers themselves).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

from router import __version__

# The router's own groups are imported below. Other packages add theirs through this entry
# point group (the workbench adds bench, demo and sim: pyproject.toml), so the router never
# imports them and runs without them: an install without the workbench lacks those commands.
COMMANDS_GROUP = "kvrouter.commands"
DESCRIPTION = (
    "kvrouter: a cache-aware load balancer for vLLM and SGLang fleets. 'kvrouter serve' "
    "runs it; 'kvrouter COMMAND --help' says more of each command."
)
WORKBENCH_HINT = "pip install 'kvrouter[bench]' from a checkout of the repository"
# Libraries the CLI uses that log a line per HTTP request at INFO.
QUIET_LIBRARIES = ("httpx", "httpcore")

Register = Callable[["argparse._SubParsersAction[Any]"], None]


def add_installed_commands(commands: argparse._SubParsersAction[Any]) -> dict[str, str]:
    """Add the command groups other packages installed; return, by name, the groups left
    out with the top-level module each lacks.

    A group whose module, or a module it imports, is not installed (the workbench's files
    or its ``[bench]`` extra) is absent, not an error: the router runs without it. Any
    other error while importing or registering one is a bug, and is raised.
    """
    absent: dict[str, str] = {}
    for point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name):
        try:
            register: Register = point.load()
            register(commands)
        except ModuleNotFoundError as exc:
            absent[point.name] = (exc.name or point.module).partition(".")[0]
    return absent


class _Parser(argparse.ArgumentParser):
    """Says how to install a command group that is absent rather than 'invalid choice'."""

    absent: dict[str, str]

    def error(self, message: str) -> NoReturn:
        for name in getattr(self, "absent", {}):
            if f"invalid choice: '{name}'" in message:
                message = f"'{name}' is part of the workbench, not installed here: {WORKBENCH_HINT}"
        super().error(message)


def build_parser(*, installed: bool = True) -> argparse.ArgumentParser:
    """The parser for every command; with ``installed=False``, the router's own commands
    only (as in the router's image, which has no workbench)."""
    from router.cli import admin, capacity, serve, top

    parser = _Parser(prog="kvrouter", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"kvrouter {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(commands)
    top.register(commands)
    capacity.register(commands)
    admin.register(commands)
    absent = add_installed_commands(commands) if installed else {}
    parser.absent = absent
    if absent:
        missing = ", ".join(sorted(set(absent.values())))
        parser.epilog = (
            f"Not installed here: {', '.join(absent)} (needs {missing}: {WORKBENCH_HINT})."
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if logging.getLogger().level > logging.DEBUG:
        for name in QUIET_LIBRARIES:
            logging.getLogger(name).setLevel(logging.WARNING)
    result: int = args.func(args)
    return result
