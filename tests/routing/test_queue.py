"""The router's queue end to end: over simulated engines and real HTTP, a request whose
worker is full waits at the router, cached turns go before fresh long prompts, classes
and deadlines shed with Retry-After in each API's shape, a client that leaves while
held leaves the queue, and the settings change at run time."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from router.config import AdmissionConfig
from router.errors import retry_after_headers
from router.fleet.workers import Fleet, Worker
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
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
    set_faults,
    wait_for,
)

LONG = chat_body([{"role": "user", "content": "long"}], max_tokens=20_000)
SHORT = chat_body([{"role": "user", "content": "short"}], max_tokens=2)
ONE_AT_A_TIME = AdmissionConfig(enabled=True, max_outstanding_per_worker=1)


@contextlib.asynccontextmanager
async def queue_router(
    engine_factory: EngineFactory, limits: AdmissionConfig | None = None, engines_n: int = 1
) -> AsyncIterator[tuple[list[RunningEngine], RunningRouter, aiohttp.ClientSession]]:
    """Simulated engines, a router over them with the queue as ``limits`` says (None:
    the default, off), and a client."""
    overrides = {} if limits is None else {"admission": limits}
    async with (
        engines(engine_factory, engines_n) as fleet,
        serve_router(router_config(fleet, **overrides)) as router,
        aiohttp.ClientSession() as http,
    ):
        yield fleet, router, http


async def _depth(http: aiohttp.ClientSession, router: RunningRouter, priority: str) -> float:
    return await metric(http, router, "kvrouter_queue_depth", priority=priority)


async def _held(http: aiohttp.ClientSession, router: RunningRouter, count: int) -> None:
    async def reached() -> bool:
        return await metric(http, router, "kvrouter_queue_depth") == count

    await wait_for(reached)


async def test_a_full_worker_holds_requests_at_the_router_then_serves(
    engine_factory: EngineFactory,
) -> None:
    async with queue_router(engine_factory, ONE_AT_A_TIME) as (fleet, router, http):
        async with held_stream(http, router.url, LONG):
            waiting = asyncio.create_task(post(http, router.url, SHORT))
            await _held(http, router, 1)
            assert not waiting.done()
            assert not fleet[0].engine.scheduler.waiting
        result = await asyncio.wait_for(waiting, 10)  # the long one left: room again
        assert result.status == 200
        assert await _depth(http, router, "interactive") == 0
        held = await metric(http, router, "kvrouter_queue_held_total", reason="ceiling")
        assert held == 1 and await metric(http, router, "kvrouter_queue_held_total") == 1
        waited = await metric(http, router, "kvrouter_queue_wait_seconds_count")
        assert waited == 2  # the long one at once, the short one after its wait


async def test_off_by_default(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
        held_stream(http, router.url, LONG),
    ):
        result = await asyncio.wait_for(post(http, router.url, SHORT), 5)
        assert result.status == 200
        assert await metric(http, router, "kvrouter_queue_wait_seconds_count") == 0


async def test_a_cached_turn_goes_before_a_fresh_long_prompt_held_before_it(
    engine_factory: EngineFactory,
) -> None:
    history = conversation("agent", 3000, 200)
    async with queue_router(engine_factory, ONE_AT_A_TIME) as (_fleet, router, http):
        first = await post(http, router.url, chat_body(history, max_tokens=16))
        assert first.status == 200
        follow_up = [
            *history,
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and then?"},
        ]
        fresh = conversation("fresh", 30_000, 200)
        ended: list[str] = []

        async def send(name: str, messages: list[dict[str, Any]]) -> None:
            assert (await post(http, router.url, chat_body(messages, max_tokens=4))).status == 200
            ended.append(name)

        async with held_stream(http, router.url, LONG):
            fresh_task = asyncio.create_task(send("fresh", fresh))
            await _held(http, router, 1)
            cached_task = asyncio.create_task(send("cached", follow_up))
            await _held(http, router, 2)
        await asyncio.wait_for(asyncio.gather(fresh_task, cached_task), 20)
        # One at a time: the first released ended before the other began.
        assert ended == ["cached", "fresh"]


async def test_a_full_queue_sheds_with_429_and_anthropic_gets_529(
    engine_factory: EngineFactory,
) -> None:
    limits = AdmissionConfig(
        enabled=True, max_outstanding_per_worker=1, queue_size=1, min_retry_after_s=0.25
    )
    messages_body = {
        "model": TEST_MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with queue_router(engine_factory, limits) as (_fleet, router, http):
        async with held_stream(http, router.url, LONG):
            queued = asyncio.create_task(post(http, router.url, SHORT))
            await _held(http, router, 1)
            refused = await post(http, router.url, SHORT)
            assert refused.status == 429
            # Whole seconds for HTTP, and in milliseconds for the SDKs, which read that
            # first: a quarter of a second at least (what is held could start sooner).
            wait_ms = int(refused.headers["retry-after-ms"])
            assert 250 <= wait_ms < 1000  # the held prompt is short: the least wait
            assert int(refused.headers["Retry-After"]) == max(1, math.ceil(wait_ms / 1000))
            error = orjson.loads(refused.raw)["error"]
            assert error["type"] == "rate_limit_error" and "queue is full" in error["message"]
            async with http.post(router.url + "/v1/messages", json=messages_body) as answer:
                assert answer.status == 529
                body = await answer.json()
                assert body["type"] == "error"
                assert body["error"]["type"] == "overloaded_error"
                assert "Retry-After" in answer.headers
                assert int(answer.headers["retry-after-ms"]) >= 250
        assert (await queued).status == 200
        sheds = await metric(http, router, "kvrouter_queue_sheds_total", reason="queue_full")
        assert sheds == 2


def test_the_wait_a_refusal_asks_for_is_rounded_up_in_both_headers() -> None:
    """Never 0 ms (the SDKs would take it as no answer and back off on their own), and
    the whole seconds never below the milliseconds."""
    assert retry_after_headers(0.0001) == {"Retry-After": "1", "retry-after-ms": "1"}
    assert retry_after_headers(0.25) == {"Retry-After": "1", "retry-after-ms": "250"}
    assert retry_after_headers(1.2) == {"Retry-After": "2", "retry-after-ms": "1200"}


async def test_a_request_that_cannot_start_within_its_deadline_is_shed(
    engine_factory: EngineFactory,
) -> None:
    limits = AdmissionConfig(enabled=True, max_outstanding_per_worker=1, queue_timeout_s=0.3)
    async with queue_router(engine_factory, limits) as (_fleet, router, http):
        async with held_stream(http, router.url, LONG):
            refused = await asyncio.wait_for(post(http, router.url, SHORT), 5)
            assert (
                refused.status == 429
                and "deadline" in orjson.loads(refused.raw)["error"]["message"]
            )
            assert await metric(http, router, "kvrouter_queue_depth") == 0
        assert (await post(http, router.url, SHORT)).status == 200
        shed = await metric(
            http, router, "kvrouter_queue_sheds_total", priority="interactive", reason="deadline"
        )
        assert shed == 1


async def test_interactive_goes_before_batch_and_displaces_it_from_a_full_queue(
    engine_factory: EngineFactory,
) -> None:
    limits = AdmissionConfig(
        enabled=True, max_outstanding_per_worker=1, queue_size=2, batch_api_keys=("batch-key",)
    )
    batch = {"Authorization": "Bearer batch-key"}
    agent = {"Authorization": "Bearer agent-key"}
    async with engines(engine_factory, 1) as fleet:
        config = router_config(fleet, api_keys=("batch-key", "agent-key"), admission=limits)
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            ended: list[str] = []

            async def send(name: str, headers: dict[str, str]) -> int:
                url = router.url + "/v1/chat/completions"
                async with http.post(url, json=SHORT, headers=headers) as response:
                    await response.read()
                ended.append(name)
                return response.status

            long_stream = await http.post(
                router.url + "/v1/chat/completions", json=LONG, headers=agent
            )
            await long_stream.content.readany()
            first_batch = asyncio.create_task(send("batch-1", batch))
            await _held(http, router, 1)
            lowered = asyncio.create_task(
                send("lowered", {**agent, "X-Kvrouter-Priority": "batch"})
            )
            await _held(http, router, 2)
            interactive = asyncio.create_task(send("interactive", agent))
            # The queue is full: the newest batch request makes room for it.
            assert await asyncio.wait_for(lowered, 5) == 429
            assert await _depth(http, router, "batch") == 1
            assert await _depth(http, router, "interactive") == 1
            long_stream.close()
            assert await asyncio.wait_for(interactive, 10) == 200
            assert await asyncio.wait_for(first_batch, 10) == 200
            assert ended == ["lowered", "interactive", "batch-1"]
            displaced = await metric(
                http, router, "kvrouter_queue_sheds_total", priority="batch", reason="displaced"
            )
            assert displaced == 1


async def test_a_client_that_leaves_while_held_leaves_the_queue(
    engine_factory: EngineFactory,
) -> None:
    async with queue_router(engine_factory, ONE_AT_A_TIME) as (_fleet, router, http):
        async with held_stream(http, router.url, LONG):
            leaving = asyncio.create_task(post(http, router.url, SHORT))
            await _held(http, router, 1)
            leaving.cancel()
            await _held(http, router, 0)
            assert await metric(http, router, "kvrouter_queue_abandoned_total") == 1
        assert (await post(http, router.url, SHORT)).status == 200
        # The long one (its client left) and this one: the abandoned one reached no engine.
        assert await metric(http, router, "kvrouter_requests_total") == 2


async def test_settings_change_at_run_time(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, admin_token="admin")) as router,
        aiohttp.ClientSession(headers={"Authorization": "Bearer admin"}) as http,
    ):
        url = router.url + "/admin/admission"
        async with http.put(url, json={"enabled": True, "max_outstanding_per_worker": 1}) as put:
            assert put.status == 200
            settings = (await put.json())["settings"]
            assert settings["enabled"] is True and settings["queue_timeout_s"] == 10.0
        async with held_stream(http, router.url, LONG):
            waiting = asyncio.create_task(post(http, router.url, SHORT))
            await _held(http, router, 1)
            async with http.get(url) as got:
                assert (await got.json())["held"] == {"interactive": 1, "batch": 0}
        assert (await asyncio.wait_for(waiting, 10)).status == 200
        async with http.put(url, json={"kv_budget": 2}) as bad:
            assert bad.status == 400
            assert "kv_budget" in (await bad.json())["error"]["message"]
        async with http.put(url, json={"batch_api_keys": ["unknown"]}) as bad:
            assert bad.status == 400
        async with http.put(url, json={"enabled": False}) as off:
            assert off.status == 200
        async with held_stream(http, router.url, LONG):
            assert (await asyncio.wait_for(post(http, router.url, SHORT), 5)).status == 200


async def test_admission_and_the_choice_share_one_eligibility_check(
    engine_factory: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found: with admission on, Fleet.eligible ran for the room check and again for the
    # choice; a request's lifecycle now computes it once (a retry looks again).
    limits = AdmissionConfig(enabled=True, max_outstanding_per_worker=4)
    async with queue_router(engine_factory, limits, engines_n=2) as (_fleet, router, http):
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


async def test_a_request_the_queue_sent_is_retried_on_another_worker(
    engine_factory: EngineFactory,
) -> None:
    # Found: the queue's first dispatch left the eligible list of the admission check in
    # place, so the retry after a failure chose among it again, the failed worker included.
    async with queue_router(engine_factory, AdmissionConfig(enabled=True), engines_n=2) as (
        fleet,
        router,
        http,
    ):
        await set_faults(http, fleet[0], fail_requests=True)
        served = set()
        for i in range(6):
            body = chat_body(conversation(f"retry{i}", 300, 50), max_tokens=2)
            result = await post(http, router.url, body)
            assert result.status == 200
            served.add(result.worker)
        assert served == {"w1"}
        assert await metric(http, router, "kvrouter_retries_total") >= 1
