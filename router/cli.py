"""The ``kvrouter`` command.

Each command group lives beside the code it drives and adds its own sub-parser through a
``register(subparsers)`` function; this module only assembles them and configures logging
(libraries never configure handlers themselves).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from router import __version__


def build_parser() -> argparse.ArgumentParser:
    from bench import cli as bench_cli
    from bench import demo
    from bench.sim import cli as sim_cli
    from router import capacity_cli, serve_cli, top

    parser = argparse.ArgumentParser(prog="kvrouter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"kvrouter {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_cli.register(commands)
    top.register(commands)
    sim_cli.register(commands)
    capacity_cli.register(commands)
    bench_cli.register(commands)
    demo.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
