"""A worker that restarts loses its cache, and the router forgets it; a blip keeps it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import aiohttp

from router.config import HealthConfig, StateConfig
from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import chat_body, conversation, engines, metric, post, set_faults, wait_for

FAST_PROBES = HealthConfig(interval_s=0.05, timeout_s=1.0)


def resident(router: RunningRouter, worker: str) -> int:
    return router.state.router.index.resident_blocks(worker)


async def test_a_restart_purges_the_workers_entries(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, health=FAST_PROBES)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("restart", 400, 100)
        first = await post(http, router.url, chat_body(messages, max_tokens=8))
        assert resident(router, "w0") > 0
        async with http.post(fleet[0].url + "/sim/restart") as response:
            assert response.status == 200
        await wait_for(
            lambda: _equals(metric(http, router, "kvrouter_worker_restarts_total", worker="w0"), 1)
        )
        assert resident(router, "w0") == 0
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "again"},
        ]
        again = await post(http, router.url, chat_body(messages, max_tokens=4))
        assert again.cached == 0


async def test_a_health_blip_without_restart_keeps_the_entries(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, health=FAST_PROBES)) as router,
        aiohttp.ClientSession() as http,
    ):
        await post(http, router.url, chat_body(conversation("blip", 400, 100), max_tokens=8))
        held = resident(router, "w0")
        await set_faults(http, fleet[0], fail_health=True)
        await wait_for(
            lambda: _equals(metric(http, router, "kvrouter_worker_healthy", worker="w0"), 0)
        )
        await set_faults(http, fleet[0], fail_health=False)
        await wait_for(
            lambda: _equals(metric(http, router, "kvrouter_worker_healthy", worker="w0"), 1)
        )
        assert resident(router, "w0") == held > 0
        assert await metric(http, router, "kvrouter_worker_restarts_total") == 0


async def test_a_purge_reaches_the_other_replicas(
    engine_factory: EngineFactory, redis_url: str
) -> None:
    state = StateConfig(url=redis_url, flush_interval_s=0.005, load_interval_s=0.1)
    slow_probes = HealthConfig(interval_s=60)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, health=FAST_PROBES, state=state)) as a,
        serve_router(router_config(fleet, health=slow_probes, state=state)) as b,
        aiohttp.ClientSession() as http,
    ):
        await post(http, a.url, chat_body(conversation("purge", 400, 100), max_tokens=8))
        await wait_for(_resident_on(b, held=True))
        async with http.post(fleet[0].url + "/sim/restart"):
            pass
        # b never probes in this test: only a's purge, through Redis, can empty it.
        await wait_for(_resident_on(b, held=False))


async def _equals(value: Awaitable[float], expected: float) -> bool:
    return await value == expected


def _resident_on(router: RunningRouter, held: bool) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return (resident(router, "w0") > 0) == held

    return check
