"""The router end to end: placement, byte-for-byte streaming, every policy, models and
health; real HTTP over loopback to simulated engines, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
from collections import Counter
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from bench.textgen import text_for
from policies.registry import policy_names
from router.config import HealthConfig, WorkerConfig
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    router_config,
    serve_router,
)
from tests.router_client import (
    BLOCK,
    WORKER,
    Streamed,
    assert_idle,
    chat_body,
    conversation,
    engines,
    fake_engine,
    held_stream,
    metric,
    post,
    set_faults,
    wait_for,
)

# -- sessions and placement ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["ttft", "cache_aware"])
async def test_a_session_stays_on_its_worker_and_hits_its_cache(
    engine_factory: EngineFactory, policy: str
) -> None:
    reply_tokens = 24
    async with (
        engines(engine_factory, 3) as fleet,
        serve_router(router_config(fleet, policy=policy)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("s", 300, 60)
        turns: list[Streamed] = []
        for turn in range(4):
            result = await post(http, router.url, chat_body(messages, reply_tokens))
            assert result.status == 200 and not result.errors
            turns.append(result)
            messages += [
                {"role": "assistant", "content": result.text},
                {"role": "user", "content": text_for(f"s-u{turn + 1}", 40)},
            ]
        await assert_idle(http, router)
        engine_cached = await metric(http, router, "kvrouter_engine_cached_tokens_total")
        usage_prompt = await metric(http, router, "kvrouter_usage_prompt_tokens_total")
    assert len({t.worker for t in turns}) == 1, [t.worker for t in turns]
    assert turns[0].cached == 0
    for before, after in itertools.pairwise(turns):
        assert before.usage is not None and after.usage is not None
        # The worker kept everything the previous turn computed (prompt + reply - 1).
        computed = before.usage["prompt_tokens"] + reply_tokens - 1
        assert after.cached == computed // BLOCK * BLOCK > before.cached
    assert engine_cached == sum(t.cached for t in turns)
    assert usage_prompt == sum(t.usage["prompt_tokens"] for t in turns if t.usage)


async def test_cache_aware_diverts_a_session_from_an_overloaded_worker(
    engine_factory: EngineFactory,
) -> None:
    knobs = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.0}
    async with (
        engines(engine_factory, 3) as fleet,
        serve_router(router_config(fleet, policy="cache_aware", policy_knobs=knobs)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("busy", 200, 40)
        first = await post(http, router.url, chat_body(messages, 16))
        home = first.worker
        messages.append({"role": "assistant", "content": first.text})
        async with contextlib.AsyncExitStack() as holders:
            for i in range(3):  # loads 0, 1, 2 are balanced enough to follow the prefix
                body = chat_body(
                    [*messages, {"role": "user", "content": f"hold {i}"}], max_tokens=20_000
                )
                response, chunk = await holders.enter_async_context(
                    held_stream(http, router.url, body)
                )
                assert response.headers[WORKER] == home and chunk.startswith(b"data: ")
            assert (
                await metric(http, router, "kvrouter_worker_outstanding_requests", worker=str(home))
                == 3
            )
            # 3 - 0 > 2 outstanding requests: the next turn goes to the least loaded.
            turn = await post(
                http,
                router.url,
                chat_body([*messages, {"role": "user", "content": "next question"}], 8),
            )
            assert turn.status == 200 and turn.worker != home
            assert turn.cached == 0  # the cost of leaving the cache behind
            decisions = await metric(
                http,
                router,
                "kvrouter_routing_decisions_total",
                policy="cache_aware",
                reason="load",
            )
            assert decisions == 2  # the first turn (nothing cached) and the diverted one
        await assert_idle(http, router, wait_s=5.0)


async def test_ttft_diverts_a_session_from_a_worker_with_queued_prefill(
    engine_factory: EngineFactory,
) -> None:
    """A stalled worker's prefill queue grows; the session's next turn goes elsewhere.

    The conversation is too short to teach the router a prefill rate, so the workers'
    estimates differ only by their queues and caches.
    """
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="ttft")) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("queue", 100, 40)
        first = await post(http, router.url, chat_body(messages, 16))
        home = first.worker
        home_engine = fleet[int(str(home)[1:])]
        messages.append({"role": "assistant", "content": first.text})
        await set_faults(http, home_engine, stall=True)
        big = chat_body([*messages, {"role": "user", "content": text_for("big", 600)}], 1)
        holder = asyncio.create_task(post(http, router.url, big))

        async def queued() -> bool:
            return (
                await metric(
                    http, router, "kvrouter_worker_queued_prefill_tokens", worker=str(home)
                )
                > 600
            )

        await wait_for(queued)
        turn = await post(
            http, router.url, chat_body([*messages, {"role": "user", "content": "and then?"}], 8)
        )
        assert turn.status == 200 and turn.worker != home
        assert not holder.done()
        await set_faults(http, home_engine, stall=False)
        held = await asyncio.wait_for(holder, 10)
        assert held.status == 200 and held.worker == home  # the big turn followed the cache
        await assert_idle(http, router)


async def test_a_shared_system_prompt_spreads_under_ttft(engine_factory: EngineFactory) -> None:
    system = {"role": "system", "content": text_for("shared-sys", 1000)}
    async with (
        engines(engine_factory, 3) as fleet,
        serve_router(router_config(fleet, policy="ttft")) as router,
        aiohttp.ClientSession() as http,
    ):
        results = await asyncio.gather(
            *(
                post(
                    http,
                    router.url,
                    chat_body(
                        [system, {"role": "user", "content": text_for(f"q{i}", 30)}],
                        4,
                        stream=False,
                    ),
                )
                for i in range(12)
            )
        )
        await assert_idle(http, router)
    assert all(r.status == 200 for r in results)
    spread = Counter(r.worker for r in results)
    assert len(spread) >= 2, spread


# -- byte-for-byte streaming ---------------------------------------------------------------

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


async def test_a_stream_passes_through_byte_for_byte(engine_factory: EngineFactory) -> None:
    # A slow engine (~20 ms a step) told to stream every step sends each token in a
    # chunk of its own, so the two streams are framed alike; the sim's text is a
    # function of the request's seed.
    body = chat_body(conversation("bytes", 50, 20), 10, seed=1234)
    async with (
        engine_factory(time_scale=0.5, stream_flush_wall_s=0.0) as engine,
        serve_router(router_config([engine])) as router,
        aiohttp.ClientSession() as http,
    ):
        routed = await post(http, router.url, body)
        async with http.post(engine.url + "/sim/restart") as response:
            assert response.status == 200  # an empty cache, as the routed request found it
        direct = await post(http, engine.url, body)
    assert routed.status == direct.status == 200
    assert routed.headers["Content-Type"] == direct.headers["Content-Type"]
    assert routed.headers["Cache-Control"] == "no-cache"
    assert routed.worker == "w0" and len(routed.headers["X-Request-Id"]) == 32
    assert routed.text == direct.text and len(routed.text) == 10 * 4
    assert routed.raw.count(b"\n\n") == 10 + 3  # role chunk, 10 tokens, usage, [DONE]
    assert _VOLATILE.sub(rb'"\1":0', routed.raw) == _VOLATILE.sub(rb'"\1":0', direct.raw)


# An SSE body as a fake engine sends it, cut at awkward places: inside a line, inside a
# UTF-8 character, between "\r" and "\n", with a comment line the capture must skip.
_ODD_BODY = (
    b": keep-alive\r\n\r\n"
    b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    + 'data: {"id":"x","choices":[{"index":0,"delta":{"content":"h\u00e9llo \u2713"}}]}'.encode()
    + b"\r\n\r\n"
    + b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":7}}}\n\ndata: [DONE]\n\n'
)
_ODD_CUTS = (3, 17, 90, 91, 140, 141, 142, 160, 161, 200, len(_ODD_BODY))


async def _odd_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "X-Engine-Header": "kept"}
    )
    await response.prepare(request)
    start = 0
    for end in _ODD_CUTS:
        await response.write(_ODD_BODY[start:end])
        start = end
        await asyncio.sleep(0.005)
    await response.write_eof()
    return response


async def test_odd_chunking_passes_through_byte_for_byte() -> None:
    async with fake_engine(_odd_stream) as url:
        config = router_config([], workers=(WorkerConfig(url, name="fake", kv_tokens=10_000),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            async with http.post(
                router.url + "/v1/chat/completions",
                json=chat_body([{"role": "user", "content": "hi"}]),
            ) as response:
                raw = await response.read()
                assert response.headers["X-Engine-Header"] == "kept"
                assert response.headers[WORKER] == "fake"
            assert raw == _ODD_BODY
            assert await metric(http, router, "kvrouter_engine_cached_tokens_total") == 7
            await assert_idle(http, router)


# -- every policy, models, health ----------------------------------------------------------


@pytest.mark.parametrize("policy", policy_names())
async def test_every_policy_serves(engine_factory: EngineFactory, policy: str) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy=policy)) as router,
        aiohttp.ClientSession() as http,
    ):
        session = conversation("p", 100, 20)
        results = [
            await post(http, router.url, chat_body(session, 4, stream=i % 2 == 0, user="u1"))
            for i in range(3)
        ]
        results.append(
            await post(
                http,
                router.url,
                {"model": TEST_MODEL, "prompt": "x" * 300, "max_tokens": 3, "stream": True},
                path="/v1/completions",
            )
        )
        assert [r.status for r in results] == [200] * 4
        assert all(r.worker in ("w0", "w1") for r in results)
        assert await metric(http, router, "kvrouter_routing_decisions_total", policy=policy) == 4
        await assert_idle(http, router)


async def test_models_health_and_readiness(engine_factory: EngineFactory) -> None:
    health = HealthConfig(interval_s=0.1, timeout_s=0.5)
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(engine_factory(served_model_name="model-a"))
        b = await stack.enter_async_context(engine_factory(served_model_name="model-b"))
        async with (
            serve_router(router_config([a, b], health=health)) as router,
            aiohttp.ClientSession() as http,
        ):
            async with http.get(router.url + "/v1/models") as response:
                listed = await response.json()
            assert listed["object"] == "list"
            assert [m["id"] for m in listed["data"]] == ["model-a", "model-b"]
            for model, worker in (("model-a", "w0"), ("model-b", "w1"), ("model-b", "w1")):
                result = await post(
                    http, router.url, {**chat_body(conversation("m", 20, 5), 2), "model": model}
                )
                assert (result.status, result.worker) == (200, worker)
            assert (
                await post(
                    http, router.url, {**chat_body(conversation("m", 20, 5)), "model": "model-c"}
                )
            ).status == 404
            async with http.get(router.url + "/health") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "ok"
            async with http.get(router.url + "/ready") as response:
                assert response.status == 200
                assert await response.json() == {"ready": True, "healthy_workers": ["w0", "w1"]}

            await stack.aclose()  # every engine goes down

            async def not_ready() -> bool:
                async with http.get(router.url + "/ready") as response:
                    return response.status == 503

            await wait_for(not_ready)
            async with http.get(router.url + "/ready") as response:
                assert await response.json() == {"ready": False, "healthy_workers": []}
            result = await post(
                http, router.url, {**chat_body(conversation("m", 20, 5)), "model": "model-a"}
            )
            assert result.status == 503
            assert orjson.loads(result.raw)["error"]["type"] == "server_error"
            async with http.get(router.url + "/health") as response:
                assert response.status == 200
            await assert_idle(http, router)


async def test_the_openai_client_streams_through_the_router(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, serve_router(router_config(fleet)) as router:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        try:
            messages: Any = conversation("oa", 200, 30)
            usages = []
            for _ in range(2):
                stream = await client.chat.completions.create(
                    model=TEST_MODEL,
                    messages=messages,
                    max_tokens=10,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                text, usage = "", None
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices and chunk.choices[0].delta.content:
                        text += chunk.choices[0].delta.content
                assert len(text) == 10 * 4 and usage is not None
                assert usage.completion_tokens == 10
                usages.append(usage)
            details = usages[1].prompt_tokens_details
            assert details is not None
            assert details.cached_tokens == (usages[1].prompt_tokens - 1) // BLOCK * BLOCK
            with pytest.raises(openai.NotFoundError) as info:
                await client.chat.completions.create(model="nope", messages=messages)
            assert info.value.status_code == 404
        finally:
            await client.close()
