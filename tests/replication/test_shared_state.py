"""Router replicas sharing state through a real redis-server (started by the fixtures)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Awaitable
from typing import Any

import aiohttp
import redis.asyncio as aioredis

from bench.textgen import text_for
from router.config import CapacityConfig, RouterConfig, StateConfig
from router.replication.index import SharedPrefixIndex
from tests.conftest import (
    EngineFactory,
    RedisServer,
    RunningEngine,
    RunningRouter,
    router_config,
    serve_router,
)
from tests.router_client import (
    chat_body,
    conversation,
    engines,
    held_stream,
    metric,
    post,
    session_turns,
    wait_for,
)


def fast_sync(url: str, key_ttl_s: float = 3600.0) -> StateConfig:
    return StateConfig(url=url, flush_interval_s=0.005, load_interval_s=0.1, key_ttl_s=key_ttl_s)


def shared_config(fleet: list[RunningEngine], url: str, **overrides: Any) -> RouterConfig:
    return router_config(fleet, state=fast_sync(url), **overrides)


async def synced(http: aiohttp.ClientSession, routers: list[RunningRouter]) -> None:
    """Wait until every replica has applied every other replica's index changes.

    A reply can reach the client before its replica has recorded (or sent) the change it
    makes to the index; so first every replica's requests have ended and its outbox is
    empty, then every change sent has been received everywhere else."""

    async def quiet() -> bool:
        for r in routers:
            index = r.state.router.index
            assert isinstance(index, SharedPrefixIndex)
            if index.outbox or any(w.outstanding_requests for w in r.state.router.fleet.all()):
                return False
        return True

    await wait_for(quiet)

    async def ready() -> bool:
        sent = [
            await metric(http, r, "kvrouter_redis_index_events_total", direction="out")
            for r in routers
        ]
        got = [
            await metric(http, r, "kvrouter_redis_index_events_total", direction="in")
            for r in routers
        ]
        return all(got[i] >= sum(sent) - sent[i] for i in range(len(routers)))

    await wait_for(ready)


async def published(http: aiohttp.ClientSession, router: RunningRouter) -> None:
    """Wait until the replica has sent every index change it made."""
    index = router.state.router.index
    assert isinstance(index, SharedPrefixIndex)

    async def done() -> bool:
        sent = await metric(http, router, "kvrouter_redis_index_events_total", direction="out")
        return not index.outbox and sent > 0

    await wait_for(done)


async def run_session(
    http: aiohttp.ClientSession,
    routers: list[RunningRouter],
    key: str,
    turns: int,
    rng: random.Random,
) -> list[tuple[str, int]]:
    """A session whose turns go to a replica picked at random; (worker, cached) a turn."""
    messages = conversation(key, 400, 200)
    seen = []
    for turn in range(turns):
        router = rng.choice(routers)
        result = await post(http, router.url, chat_body(messages, max_tokens=24))
        assert result.status == 200
        seen.append((result.headers["X-Kvrouter-Worker"], result.cached))
        messages += [
            {"role": "assistant", "content": result.text},
            {"role": "user", "content": text_for(f"{key}-u{turn + 1}", 150)},
        ]
        await synced(http, routers)
    return seen


async def test_replicas_keep_sessions_on_their_workers(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    rng = random.Random(3)
    async with (
        engines(engine_factory, 3) as fleet,
        serve_router(shared_config(fleet, redis_url)) as a,
        serve_router(shared_config(fleet, redis_url)) as b,
        serve_router(shared_config(fleet, redis_url)) as c,
        aiohttp.ClientSession() as http,
    ):
        for key in ("s1", "s2", "s3"):
            seen = await run_session(http, [a, b, c], key, 5, rng)
            workers = {w for w, _ in seen}
            assert len(workers) == 1, seen
            cached = [c for _, c in seen]
            assert cached[0] == 0 and all(x < y for x, y in itertools.pairwise(cached[1:]))
            assert cached[1] > 0


async def test_a_restarted_replica_starts_warm(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with engines(engine_factory, 3) as fleet, aiohttp.ClientSession() as http:
        sessions = {key: conversation(key, 400, 200) for key in ("w1", "w2", "w3", "w4")}
        placed = {}
        async with serve_router(shared_config(fleet, redis_url, seed=1)) as first:
            for key, messages in sessions.items():
                result = await post(http, first.url, chat_body(messages, max_tokens=24))
                placed[key] = result.headers["X-Kvrouter-Worker"]
                messages += [
                    {"role": "assistant", "content": result.text},
                    {"role": "user", "content": "and then?"},
                ]
            await published(http, first)
        assert len(set(placed.values())) > 1  # spread, so a lucky guess cannot pass
        async with serve_router(shared_config(fleet, redis_url, seed=2)) as second:
            assert second.state.router.index.size() > 0
            for key, messages in sessions.items():
                again = await post(http, second.url, chat_body(messages, max_tokens=4))
                assert again.headers["X-Kvrouter-Worker"] == placed[key]
                assert again.cached > 0


async def test_load_is_shared_and_expires_with_its_replica(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(shared_config(fleet, redis_url)) as b,
        aiohttp.ClientSession() as http,
    ):
        async with serve_router(shared_config(fleet, redis_url)) as a:
            body = chat_body(conversation("held", 50, 50), max_tokens=20_000)
            async with held_stream(http, a.url, body):

                async def b_sees_it() -> bool:
                    return sum(w.remote_requests for w in b.state.router.fleet.all()) == 1

                await wait_for(b_sees_it)

        # a is gone: its contribution expires instead of counting forever.
        async def expired() -> bool:
            return all(w.remote_requests == 0 for w in b.state.router.fleet.all())

        await wait_for(expired, timeout_s=5)


async def test_redis_down_and_back_loses_no_request(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str
) -> None:
    rng = random.Random(5)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(shared_config(fleet, redis_url)) as a,
        serve_router(shared_config(fleet, redis_url)) as b,
        aiohttp.ClientSession() as http,
    ):

        def traffic(key: str) -> Awaitable[list[int]]:
            return session_turns(http, lambda: rng.choice([a, b]).url, key, 8)

        load = asyncio.gather(*(traffic(f"k{i}") for i in range(4)))
        await asyncio.sleep(0.15)
        redis_server.stop()
        await wait_for(lambda: _gauge_is(http, a, "kvrouter_redis_up", 0))
        await asyncio.sleep(0.2)
        redis_server.start()  # empty: no persistence
        statuses = await load
        assert all(s == 200 for group in statuses for s in group), statuses
        await wait_for(lambda: _gauge_is(http, a, "kvrouter_redis_up", 1), timeout_s=10)
        assert await metric(http, a, "kvrouter_redis_errors_total") > 0
        # The empty Redis is rebuilt from the replicas' state.
        client = aioredis.Redis.from_url(redis_url)
        try:

            async def rebuilt() -> bool:
                return bool(await client.keys("kvr:*:res:*"))

            await wait_for(rebuilt, timeout_s=10)
        finally:
            await client.aclose()


async def test_residency_keys_are_capped_and_expire(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    async with engines(engine_factory, 1) as fleet, aiohttp.ClientSession() as http:
        config = router_config(
            fleet, state=fast_sync(redis_url, key_ttl_s=30), capacity=CapacityConfig(kv_tokens=640)
        )  # 10 blocks of 64 tokens
        async with serve_router(config) as router:
            for i in range(6):
                await post(
                    http, router.url, chat_body(conversation(f"cap{i}", 300, 100), max_tokens=2)
                )
            await wait_for(
                lambda: metric(http, router, "kvrouter_redis_index_events_total", direction="out")
            )
            await asyncio.sleep(0.1)
        client = aioredis.Redis.from_url(redis_url)
        try:
            (key,) = await client.keys("kvr:*:res:*")
            assert 0 < await client.zcard(key) <= 10
            assert 0 < await client.pttl(key) <= 30_000
        finally:
            await client.aclose()


async def test_unreachable_redis_at_start_routes_on_local_state(
    engine_factory: EngineFactory,
) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        dead = "redis://127.0.0.1:1/0"
        async with serve_router(shared_config(fleet, dead)) as router:
            messages = conversation("alone", 300, 100)
            first = await post(http, router.url, chat_body(messages, max_tokens=8))
            messages += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": "more"},
            ]
            second = await post(http, router.url, chat_body(messages, max_tokens=8))
            assert first.status == second.status == 200
            assert second.headers["X-Kvrouter-Worker"] == first.headers["X-Kvrouter-Worker"]
            assert second.cached > 0
            assert await _gauge_is(http, router, "kvrouter_redis_up", 0)


async def _gauge_is(
    http: aiohttp.ClientSession, router: RunningRouter, name: str, value: float
) -> bool:
    return await metric(http, router, name) == value
