"""Replicas as separate processes: ``kvrouter serve --state`` twice (each its own
interpreter, event loop and connections) over one fleet and one redis-server, as
operators run them behind a load balancer without affinity.

The in-process tests (tests/replication/test_read_your_writes.py,
tests/replication/test_shared_state.py) hold the detail; these check that it holds
between real processes: turns alternating between replicas, Redis slowed, Redis killed
and started again empty under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import sys
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.compare.demo import stop_process
from bench.ports import free_port_run
from router.config import RouterConfig
from router.processes.slot import write_config
from tests.conftest import EngineFactory, RedisServer, RunningEngine
from tests.replication.test_read_your_writes import (
    alternate_turns,
    replica_config,
    served_past_the_bound,
)
from tests.router_client import (
    engines,
    metric,
    session_turns,
    wait_for,
)
from tests.tcp_proxy import tcp_proxy

START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class ReplicaProcess:
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()


def _prepare(config: RouterConfig, run_dir: Path) -> tuple[Path, Path]:
    """The config file for ``config`` and the log's path, in a new ``run_dir``."""
    run_dir.mkdir()
    return write_config(config, run_dir), run_dir / "replica.log"


@contextlib.asynccontextmanager
async def serve_replica(config: RouterConfig, run_dir: Path) -> AsyncIterator[ReplicaProcess]:
    """``kvrouter serve --config`` with ``config`` on a free port, until it answers."""
    port = free_port_run(1)
    path, log = _prepare(dataclasses.replace(config, port=port), run_dir)
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "serve", "--config", str(path),
            stdout=out, stderr=out,
        )  # fmt: skip
    replica = ReplicaProcess(f"http://127.0.0.1:{port}", log)
    try:
        await _answering(replica, process)
        yield replica
    finally:
        await stop_process(process, timeout_s=30)


async def _answering(replica: ReplicaProcess, process: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(int(START_TIMEOUT_S / 0.05)):
            assert process.returncode is None, replica.output()
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(replica.url + "/metrics") as reply:
                    if reply.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError(f"the replica did not start: {replica.output()}")


@contextlib.asynccontextmanager
async def replica_processes(
    fleet: list[RunningEngine], tmp_path: Path, *urls: str, **state: Any
) -> AsyncIterator[tuple[list[ReplicaProcess], aiohttp.ClientSession]]:
    """A replica process for each Redis URL in ``urls``, each aware of the others."""
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                serve_replica(replica_config(fleet, url, seed, **state), tmp_path / f"r{seed}")
            )
            for seed, url in enumerate(urls, start=1)
        ]
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def met() -> bool:
            counts = [await metric(http, r, "kvrouter_redis_replicas") for r in replicas]
            return all(count == len(replicas) for count in counts)

        await wait_for(met, timeout_s=20)
        yield replicas, http


async def test_turns_alternating_between_replica_processes_all_find_their_history(
    engine_factory: EngineFactory, redis_url: str, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 4) as fleet,
        replica_processes(fleet, tmp_path, redis_url, redis_url) as (replicas, http),
    ):
        # The mirrors flush every 5 s: only the request path can carry a turn across.
        seen = await alternate_turns(http, replicas)
    for turns in seen:
        assert len({worker for worker, _ in turns}) == 1, seen
        assert all(cached > 0 for _, cached in turns[1:]), seen


async def test_a_slow_redis_keeps_a_replica_process_within_the_bound(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        tcp_proxy(redis_server.port) as proxy,
        replica_processes(fleet, tmp_path, proxy.url, redis_url, path_timeout_s=0.005) as (
            (slowed, _),
            http,
        ),
    ):
        proxy.delay_s = 0.2  # every Redis reply to the first replica a fifth of a second late
        given_up = await served_past_the_bound(http, slowed)
    # Each session's first request asks (nobody holds its system prompt); every request
    # reserves and records; every one of those round trips gave up at the bound.
    assert given_up == {"lookup": 3, "reserve": 6, "record": 6}


async def test_redis_killed_and_started_empty_under_load_loses_no_request_and_is_rebuilt(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str, tmp_path: Path
) -> None:
    rng = random.Random(12)
    async with (
        engines(engine_factory, 2) as fleet,
        replica_processes(fleet, tmp_path, redis_url, redis_url, flush_interval_s=0.02) as (
            replicas,
            http,
        ),
    ):

        def session(key: str) -> Awaitable[list[int]]:
            return session_turns(
                http, lambda: rng.choice(replicas).url, key, 10, lambda turn: turn % 2 == 0
            )

        async def redis_up(value: float) -> bool:
            ups = [await metric(http, r, "kvrouter_redis_up") for r in replicas]
            return all(up == value for up in ups)

        load = asyncio.gather(*(session(f"k{i}") for i in range(4)))
        await asyncio.sleep(0.2)
        redis_server.stop()
        await wait_for(lambda: redis_up(0), timeout_s=10)
        await asyncio.sleep(0.2)
        redis_server.start()  # empty: no persistence
        statuses = await load
        assert all(s == 200 for group in statuses for s in group), statuses
        await wait_for(lambda: redis_up(1), timeout_s=15)
        client = aioredis.Redis.from_url(redis_url)
        try:

            async def rebuilt() -> bool:
                # Both replicas' residency again, for both workers.
                return len(await client.keys("kvr:*:res:*")) == len(fleet)

            await wait_for(rebuilt, timeout_s=15)
        finally:
            await client.aclose()
        # And the rebuilt state routes: turns alternating between the replicas still
        # land where their history is.
        seen = await alternate_turns(http, replicas)
    for turns in seen:
        assert all(cached > 0 for _, cached in turns[1:]), seen
