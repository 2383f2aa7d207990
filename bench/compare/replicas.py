"""``kvrouter bench replicas``: 1, 2, 4, 8 router replicas sharing state through Redis.

One fleet and one workload (the demo's agent sessions, or a ``bench matrix`` row's with
its fleet's KV size, ``--row``); for each replica count, the replicas start on
consecutive ports with ``--state`` pointing at one redis-server (started here on a free
port, emptied before each run), and the replay sends each request to a replica picked at
random or to each replica in turn (``--assign``), as a load balancer without affinity
would. Hit rate, TTFT and load imbalance across workers (coefficient of variation of
requests and of prefilled tokens) are compared with the single replica; with shared
state, each run also reports the Redis round trips a request made on its path, the mean
wait before forwarding and the 50th and 99th percentiles of one round trip's wait, read
from the replicas' ``/metrics``.
``--mirrors-only`` runs replica counts with shared state but without those round trips
(``--no-read-your-writes``), ``--unshared`` with private indexes, for contrast.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from bench.compare.demo import (
    DemoConfig,
    RouterSpec,
    add_workload_arguments,
    demo_config,
    demo_workload,
    kvrouter_command,
    run_comparison,
)
from bench.compare.matrix import Row, rows
from bench.ports import port_for_later
from bench.replay.client import ASSIGNS, Assign


@contextlib.asynccontextmanager
async def redis_server() -> AsyncIterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (apt-get install redis-server)")
    port = port_for_later()
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


@dataclass(frozen=True, slots=True)
class ReplicaRuns:
    """Which replica counts to run, and how."""

    counts: Sequence[int]
    assigns: Sequence[Assign] = ("random",)
    mirrors_only: Sequence[int] = ()  # shared state without read-your-writes
    unshared: Sequence[int] = ()  # private indexes


def replica_specs(
    config: DemoConfig, runs: ReplicaRuns, policy: str, redis_url: str, urls: Sequence[str]
) -> list[RouterSpec]:
    """Shared-state runs for each count and way of spreading requests, then the
    contrasts: shared state read from the mirrors alone, and private indexes (what
    routers without shared state do)."""
    # (count, serve flags, label suffix, how the replay spreads requests)
    modes: list[tuple[int, tuple[str, ...], str, Assign]] = []
    for count in runs.counts:
        for assign in runs.assigns if count > 1 else runs.assigns[:1]:
            suffix = assign.replace("_", "-") if count > 1 else ""
            modes.append((count, ("--state", redis_url), suffix, assign))
    for count in runs.mirrors_only:
        flags: tuple[str, ...] = ("--state", redis_url, "--no-read-your-writes")
        modes.append((count, flags, "mirrors only", "random"))
    for count in runs.unshared:
        modes.append((count, (), "private", "random"))
    specs = []
    for count, flags, suffix, spread in modes:
        ports = tuple(config.router_port + i for i in range(count))
        commands = tuple(kvrouter_command(config, policy, urls, port, *flags) for port in ports)
        label = f"{count} replica{'s' if count > 1 else ''}" + (f", {suffix}" if suffix else "")
        specs.append(RouterSpec(label, commands, ports, spread))
    return specs


# The path's round trips a request waits on before it is forwarded.
BEFORE_FORWARDING = ("lookup", "reserve")


async def redis_figures(http: aiohttp.ClientSession, urls: Sequence[str]) -> dict[str, float]:
    """From the replicas' ``/metrics`` (summed over the replicas): Redis round trips per
    request on their paths and the share of them given up at ``state.path_timeout_s``,
    the mean time a request waited on Redis before it was forwarded (lookup and
    reserve; the record waits before the final chunk, not the first), and the 50th and
    99th percentiles of one round trip's wait."""
    trips = timeouts = requests = waited_before_forwarding = 0.0
    buckets: dict[float, float] = {}
    for url in urls:
        async with http.get(f"{url}/metrics") as response:
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvrouter_redis_path_operations_total":
                    result = sample.labels["result"]
                    trips += sample.value if result != "late" else 0  # "late": counted once
                    timeouts += sample.value if result == "timeout" else 0
                elif sample.name == "kvrouter_requests_total":
                    requests += sample.value
                elif sample.name == "kvrouter_redis_path_seconds_bucket":
                    bound = float(sample.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + sample.value
                elif sample.name == "kvrouter_redis_path_seconds_sum":
                    op = sample.labels["op"]
                    waited_before_forwarding += sample.value if op in BEFORE_FORWARDING else 0
    figures: dict[str, float] = {}
    if requests:
        figures["redis_trips"] = trips / requests
        figures["redis_wait_before_forwarding"] = waited_before_forwarding / requests
    if trips:
        figures["redis_timeouts"] = timeouts / trips
    for key, q in (("redis_wait_p50", 0.5), ("redis_wait_p99", 0.99)):
        quantile = bucket_quantile(buckets, q)
        if quantile is not None:
            figures[key] = quantile
    return figures


def bucket_quantile(cumulative: dict[float, float], q: float) -> float | None:
    """A quantile from cumulative histogram buckets (upper bound -> count), linear
    within the bucket, as Prometheus's histogram_quantile does."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] == 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower_bound = lower_count = 0.0
    for bound in bounds:
        count = cumulative[bound]
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


async def run_replicas(
    config: DemoConfig, runs: ReplicaRuns, policy: str, console: Console, row: Row | None = None
) -> None:
    async with redis_server() as url, aiohttp.ClientSession() as http:
        client = aioredis.Redis.from_url(url)

        async def flush() -> None:
            await client.flushall()

        async def figures(spec: RouterSpec, urls: Sequence[str]) -> dict[str, float]:
            return await redis_figures(http, urls)

        try:
            await run_comparison(
                config,
                console,
                lambda urls: replica_specs(config, runs, policy, url, urls),
                flush,
                workload=row.workload if row is not None else demo_workload,
                per_engine_flags=row.per_engine_flags if row is not None else (),
                after_each=figures,
            )
        finally:
            await client.aclose()


def register(sub: argparse._SubParsersAction[Any]) -> None:
    parser = sub.add_parser(
        "replicas", help="router replicas sharing state through Redis", description=__doc__
    )
    add_workload_arguments(parser)
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts to compare")
    parser.add_argument(
        "--assign",
        default="random",
        help="how the replay spreads requests over replicas: random, round_robin or both "
        "(comma-separated)",
    )
    parser.add_argument(
        "--mirrors-only",
        default="",
        help="replica counts to run also with shared state but no Redis round trips on "
        "the request path (--no-read-your-writes), for contrast",
    )
    parser.add_argument(
        "--unshared",
        default="",
        help="replica counts to run also without shared state, for contrast",
    )
    parser.add_argument(
        "--row",
        choices=[row.name for row in rows()],
        default=None,
        help="a workload of `bench matrix` (its fleet's KV size and flags too) instead of "
        "the demo's agent sessions",
    )
    # Replicas share a redis-server, a process outside the virtual clock.
    parser.set_defaults(func=run, out=Path("results/replicas"), policies="ttft", clock="real")


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    assigns = [a for a in args.assign.split(",") if a]
    unknown = sorted(set(assigns) - set(ASSIGNS))
    if unknown or not assigns:
        raise SystemExit(f"--assign: expected random and/or round_robin, got {args.assign!r}")
    runs = ReplicaRuns(
        counts=_counts(args.replicas),
        assigns=[a for a in ASSIGNS if a in assigns],
        mirrors_only=_counts(args.mirrors_only),
        unshared=_counts(args.unshared),
    )
    row = {r.name: r for r in rows()}[args.row] if args.row else None
    if row is not None and row.kv_tokens is not None:
        config = dataclasses.replace(config, kv_tokens=row.kv_tokens)
    asyncio.run(run_replicas(config, runs, config.policies[0], Console(), row))
    return 0


def _counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]
