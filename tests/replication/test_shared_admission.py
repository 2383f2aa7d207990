"""The router's queue settings across replicas sharing a redis-server: a change on one
reaches the others, a replica started later takes the fleet's, an emptied Redis gets
them back, and client keys never reach Redis."""

from __future__ import annotations

from typing import Any

import aiohttp
import redis.asyncio as aioredis

from router.config import RouterConfig
from router.replication.keys import Keys
from tests.conftest import (
    EngineFactory,
    RedisServer,
    RunningEngine,
    RunningRouter,
    router_config,
    serve_router,
)
from tests.replication.test_shared_state import fast_sync
from tests.router_client import engines, wait_for

TOKEN = "admin-token"
KEYS = ("batch-secret", "agent-secret")


def replica(fleet: list[RunningEngine], url: str) -> RouterConfig:
    return router_config(fleet, state=fast_sync(url), admin_token=TOKEN, api_keys=KEYS)


async def _admission(
    http: aiohttp.ClientSession, router: RunningRouter, change: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    url = router.url + "/admin/admission"
    method = (
        http.get(url, headers=headers)
        if change is None
        else http.put(url, json=change, headers=headers)
    )
    async with method as response:
        return response.status, await response.json()


async def test_a_change_reaches_every_replica_and_keys_stay_out_of_redis(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with (
            engines(engine_factory, 1) as fleet,
            serve_router(replica(fleet, redis_url)) as a,
            serve_router(replica(fleet, redis_url)) as b,
            aiohttp.ClientSession() as http,
        ):
            change = {"enabled": True, "queue_timeout_s": 4, "batch_api_keys": ["batch-secret"]}
            status, changed = await _admission(http, a, change)
            assert status == 200 and changed["version"] == 1
            assert changed["settings"]["batch_api_keys"] == 1

            async def b_follows() -> bool:
                _, seen = await _admission(http, b)
                return bool(seen["version"] == 1)

            await wait_for(b_follows)
            _, seen = await _admission(http, b)
            assert seen["settings"]["enabled"] is True and seen["settings"]["queue_timeout_s"] == 4
            assert b.state.queue.enabled
            assert seen["settings"]["batch_api_keys"] == 0  # b's own: none configured
            stored = await client.hgetall(Keys("kvrouter").admission)
            assert not [v for v in stored.values() if "secret" in str(v)]

            async with serve_router(replica(fleet, redis_url)) as later:
                assert later.state.queue.settings_version == 1 and later.state.queue.enabled
    finally:
        await client.aclose()


async def test_an_emptied_redis_gets_the_fleets_settings_back(
    engine_factory: EngineFactory, redis_server: RedisServer, redis_url: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with (
            engines(engine_factory, 1) as fleet,
            serve_router(replica(fleet, redis_url)) as a,
            aiohttp.ClientSession() as http,
        ):
            status, _ = await _admission(http, a, {"enabled": True, "kv_budget": 0.5})
            assert status == 200
            redis_server.flush()  # as a Redis restarted without persistence

            async def restored() -> bool:
                return bool(await client.hgetall(Keys("kvrouter").admission))

            await wait_for(restored)
            async with serve_router(replica(fleet, redis_url)) as later:
                assert later.state.queue.limits.kv_budget == 0.5
    finally:
        await client.aclose()


async def test_fleet_settings_not_valid_here_are_ignored(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.hset(
            Keys("kvrouter").admission,
            mapping={"version": 5, "policy": "admission", "knobs": '{"kv_budget": 7}'},
        )
        async with (
            engines(engine_factory, 1) as fleet,
            serve_router(replica(fleet, redis_url)) as a,
        ):
            assert a.state.queue.settings_version == 0 and a.state.queue.limits.kv_budget == 1.0
    finally:
        await client.aclose()
