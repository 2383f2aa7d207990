"""``kvrouter bench replicas``: 1, 2, 4 router replicas sharing state through Redis.

One fleet and one agent workload; for each replica count, the replicas start on
consecutive ports with ``--state`` pointing at one redis-server (started here on a free
port, emptied before each run), and the replay sends each request to a replica picked at
random, as a load balancer without affinity would. Hit rate and TTFT are compared with
the single replica.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import socket
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from rich.console import Console

from bench.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    kvrouter_command,
    run_comparison,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = _free_port()
    process = await asyncio.create_subprocess_exec(
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = aioredis.Redis.from_url(url)
        for _ in range(100):
            with contextlib.suppress(OSError, aioredis.ConnectionError):
                await client.ping()
                break
            await asyncio.sleep(0.05)
        await client.aclose()
        yield url
    finally:
        process.terminate()
        await process.wait()


def replica_specs(
    config: DemoConfig,
    counts: Sequence[int],
    policy: str,
    redis_url: str,
    urls: Sequence[str],
    unshared: Sequence[int] = (),
) -> list[RouterSpec]:
    """Shared-state runs for ``counts``, then runs of ``unshared`` replicas that each keep
    a private index (what routers without shared state do), for contrast."""
    specs = []
    for count, shared in [(n, True) for n in counts] + [(n, False) for n in unshared]:
        ports = tuple(config.router_port + i for i in range(count))
        state = ("--state", redis_url) if shared else ()
        commands = tuple(kvrouter_command(config, policy, urls, port, *state) for port in ports)
        label = f"{count} replica{'s' if count > 1 else ''}{'' if shared else ', private'}"
        specs.append(RouterSpec(label, commands, ports))
    return specs


async def run_replicas(
    config: DemoConfig,
    counts: Sequence[int],
    policy: str,
    console: Console,
    unshared: Sequence[int] = (),
) -> None:
    async with redis_server() as url:
        client = aioredis.Redis.from_url(url)

        async def flush() -> None:
            await client.flushall()

        try:
            await run_comparison(
                config,
                console,
                lambda urls: replica_specs(config, counts, policy, url, urls, unshared),
                flush,
            )
        finally:
            await client.aclose()


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "replicas", help="router replicas sharing state through Redis", description=__doc__
    )
    add_workload_arguments(parser)
    parser.add_argument("--replicas", default="1,2,4", help="replica counts to compare")
    parser.add_argument(
        "--unshared",
        default="",
        help="replica counts to run also without shared state, for contrast",
    )
    # Replicas share a redis-server, a process outside the virtual clock.
    parser.set_defaults(func=run, out=Path("results/replicas"), policies="ttft", clock="real")


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    counts = [int(n) for n in args.replicas.split(",") if n]
    unshared = [int(n) for n in args.unshared.split(",") if n]
    asyncio.run(run_replicas(config, counts, config.policies[0], Console(), unshared))
    return 0
