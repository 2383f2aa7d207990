"""Admission control when every worker is full: queue, 429, 503 with Retry-After."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from router.config import AdmissionConfig
from router.fleet.workers import Fleet, Worker
from tests.conftest import EngineFactory, router_config, serve_router
from tests.router_client import chat_body, engines, held_stream, post

LONG = chat_body([{"role": "user", "content": "long"}], max_tokens=20_000)
SHORT = chat_body([{"role": "user", "content": "short"}], max_tokens=2)


async def test_a_full_fleet_queues_then_serves(engine_factory: EngineFactory) -> None:
    limits = AdmissionConfig(max_outstanding_per_worker=1, queue_size=4, queue_timeout_s=10)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admission=limits)) as router,
        aiohttp.ClientSession() as http,
    ):
        async with held_stream(http, router.url, LONG):
            waiting = asyncio.create_task(post(http, router.url, SHORT))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # held back, not sent to the full engine
        result = await asyncio.wait_for(waiting, 10)  # the long one left: room again
        assert result.status == 200


async def test_a_full_queue_answers_429_and_a_long_wait_503(engine_factory: EngineFactory) -> None:
    limits = AdmissionConfig(max_outstanding_per_worker=1, queue_size=1, queue_timeout_s=0.5)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admission=limits)) as router,
        aiohttp.ClientSession() as http,
    ):
        async with held_stream(http, router.url, LONG):
            queued = asyncio.create_task(post(http, router.url, SHORT))
            await asyncio.sleep(0.1)
            refused = await post(http, router.url, SHORT)
            assert refused.status == 429 and refused.headers["Retry-After"] == "1"
            timed_out = await queued
            assert timed_out.status == 503 and timed_out.headers["Retry-After"] == "1"
        assert (await post(http, router.url, SHORT)).status == 200


async def test_off_by_default(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
        held_stream(http, router.url, LONG),
    ):
        result = await asyncio.wait_for(post(http, router.url, SHORT), 5)
        assert result.status == 200


async def test_admission_and_the_choice_share_one_eligibility_check(
    engine_factory: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found: with admission on, Fleet.eligible ran for the room check and again for the
    # choice; a request's lifecycle now computes it once (a retry looks again).
    limits = AdmissionConfig(max_outstanding_per_worker=4, queue_size=4, queue_timeout_s=10)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admission=limits)) as router,
        aiohttp.ClientSession() as http,
    ):
        calls = 0
        eligible = Fleet.eligible

        def counted(self: Fleet, *args: Any, **kwargs: Any) -> list[Worker]:
            nonlocal calls
            calls += 1
            return eligible(self, *args, **kwargs)

        monkeypatch.setattr(Fleet, "eligible", counted)
        for _ in range(3):
            assert (await post(http, router.url, SHORT)).status == 200
        assert calls == 3
