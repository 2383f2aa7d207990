"""Virtual time: engines, router and replay client in one event loop whose clock jumps.

``kvrouter demo --clock virtual`` (and ``bench matrix`` / ``bench sweep``) run every
simulated engine and kvrouter itself as aiohttp apps on loopback ports inside the
benchmark's own process, on an event loop from ``looptime``: when every task is waiting
on a timer and no socket has data, the loop's clock moves straight to the next timer
instead of sleeping. Simulated time then costs only the CPU it takes to compute, and
no amount of CPU load beside the run changes what happens in it: each step of each
engine lasts exactly its roofline time, and the router's own processing takes none.

Every duration measured in the router, the engines and the replay is read from
``router.clock.monotonic``, which follows the loop's clock inside such a loop
(``VirtualTimeLoop.virtual_time``). The peer routers are separate binaries and cannot
join the loop, so comparisons with them stay on the real clock.

Routers and engines are described by the same command lines the real-clock mode
starts as processes, parsed by the ``kvrouter`` CLI itself, so both modes run the same
configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import looptime

from bench.loopback import serve_on_loopback

T = TypeVar("T")

# Idle loop passes before the clock jumps: loopback data written in one pass is
# readable in the next, so a few passes make sure no reply is still in flight.
NOOP_CYCLES = 42
HASH_SEED = "0"


class VirtualTimeLoop(looptime.LoopTimeEventLoop, asyncio.SelectorEventLoop):
    """A selector event loop with looptime's jumping clock, marked for ``router.clock``."""

    virtual_time = True

    def __init__(self) -> None:
        super().__init__(start=0.0, noop_cycles=NOOP_CYCLES)


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion on a fresh ``VirtualTimeLoop``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(main)


def ensure_hash_seed(argv: Sequence[str]) -> None:
    """Re-execute this command with a fixed ``PYTHONHASHSEED`` unless it has one: the
    iteration order of sets of strings must not differ between two runs."""
    if os.environ.get("PYTHONHASHSEED") == HASH_SEED:
        return
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED}
    os.execve(sys.executable, [sys.executable, "-m", "router.cli", *argv], env)


@dataclass(slots=True)
class InProcessEngine:
    engine_id: str
    url: str


def _cli_args(argv: Sequence[str]) -> Any:
    from router.cli import build_parser

    return build_parser().parse_args(list(argv))


@contextlib.asynccontextmanager
async def inprocess_fleet(
    n: int,
    base_port: int,
    flags: Sequence[str],
    per_engine_flags: Sequence[Sequence[str]] = (),
) -> AsyncIterator[list[InProcessEngine]]:
    """``n`` simulated engines from ``kvrouter sim engine`` flags, in this process, on
    consecutive ports: fixed ports give workers the same names (host:port) every run,
    and names order the router's ties."""
    from bench.sim.cli import engine_config
    from bench.sim.server import create_app

    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for i in range(n):
            extra = per_engine_flags[i] if i < len(per_engine_flags) else ()
            args = _cli_args(["sim", "engine", "--engine-id", str(i), *flags, *extra])
            config = engine_config(args, str(i))
            url = await stack.enter_async_context(
                serve_on_loopback(create_app(config), base_port + i)
            )
            engines.append(InProcessEngine(str(i), url))
        yield engines


def router_argv(command: Sequence[str]) -> list[str]:
    """The ``kvrouter`` arguments of a command line that runs ``python -m router.cli``."""
    try:
        start = list(command).index("router.cli") + 1
    except ValueError:
        raise ValueError(
            f"not a kvrouter command, cannot run in virtual time: {' '.join(command)}"
        ) from None
    return list(command[start:])


@contextlib.asynccontextmanager
async def inprocess_router(command: Sequence[str], port: int) -> AsyncIterator[str]:
    """``kvrouter serve`` as given by ``command``, in this process on ``port``; yields
    its URL."""
    from router.cli.serve import flag_overrides
    from router.config_loader import load_config
    from router.server import serving

    args = _cli_args(router_argv(command))
    if args.command != "serve":
        raise ValueError(f"expected a 'serve' command, got {args.command!r}")
    config = load_config(args.config, flag_overrides(args), environ={})
    async with serving(config, port=port) as (_, url):
        yield url
