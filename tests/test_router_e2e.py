"""The router end to end: real HTTP over loopback to simulated engines, real clients."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.textgen import text_for
from policies.registry import policy_names
from router.config import HealthConfig, UpstreamConfig, WorkerConfig
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    RunningEngine,
    RunningRouter,
    router_config,
    serve_router,
)

BLOCK = 16  # the engines' KV block, in tokens
WORKER = "X-Kvrouter-Worker"
LOAD_GAUGES = ("kvrouter_worker_outstanding_requests", "kvrouter_worker_outstanding_tokens",
               "kvrouter_worker_queued_prefill_tokens")


# -- helpers -------------------------------------------------------------------------------


@dataclass(slots=True)
class Streamed:
    status: int
    headers: Mapping[str, str]
    raw: bytes
    text: str = ""
    usage: dict[str, Any] | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def worker(self) -> str | None:
        return self.headers.get(WORKER)

    @property
    def cached(self) -> int:
        assert self.usage is not None
        cached: int = self.usage["prompt_tokens_details"]["cached_tokens"]
        return cached


def parse_sse(raw: bytes) -> tuple[str, dict[str, Any] | None, list[dict[str, Any]]]:
    """Content, usage and error events of a chat SSE body."""
    text, usage, errors = "", None, []
    for line in raw.split(b"\n"):
        payload = line.removeprefix(b"data:").strip()
        if not line.startswith(b"data:") or payload == b"[DONE]":
            continue
        event = orjson.loads(payload)
        if "error" in event:
            errors.append(event["error"])
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            text += choice.get("delta", {}).get("content") or choice.get("text") or ""
    return text, usage, errors


def chat_body(messages: list[dict[str, Any]], max_tokens: int = 8, stream: bool = True,
              **extra: Any) -> dict[str, Any]:
    body = {"model": TEST_MODEL, "messages": messages, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def post(http: aiohttp.ClientSession, url: str, body: Mapping[str, Any],
               path: str = "/v1/chat/completions") -> Streamed:
    """A whole request; a streamed body is parsed as SSE, a JSON one as a response."""
    async with http.post(url + path, json=body) as response:
        raw = await response.read()
        result = Streamed(response.status, response.headers, raw)
    if response.status == 200 and body.get("stream"):
        result.text, result.usage, result.errors = parse_sse(raw)
    elif response.status == 200:
        obj = orjson.loads(raw)
        choice = obj["choices"][0]
        result.text = choice["message"]["content"] if "message" in choice else choice["text"]
        result.usage = obj["usage"]
    return result


async def router_samples(http: aiohttp.ClientSession, router: RunningRouter
                         ) -> list[tuple[str, dict[str, str], float]]:
    async with http.get(router.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]


async def metric(http: aiohttp.ClientSession, router: RunningRouter, name: str,
                 **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lab, v in await router_samples(http, router)
               if n == name and labels.items() <= lab.items())


async def load(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, float]:
    """Every worker's load gauges, as ``{"<gauge>{<worker>}": value}``."""
    return {f"{n}{{{lab['worker']}}}": v for n, lab, v in await router_samples(http, router)
            if n in LOAD_GAUGES}


async def assert_idle(http: aiohttp.ClientSession, router: RunningRouter,
                      wait_s: float = 0.0) -> None:
    """Every worker's outstanding requests, tokens and queued prefill are back to 0."""
    deadline = time.monotonic() + wait_s
    while True:
        values = await load(http, router)
        assert len(values) == len(LOAD_GAUGES) * len(router.config.workers)
        if not any(values.values()) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.02)
    assert {k: v for k, v in values.items() if v} == {}


async def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def set_faults(http: aiohttp.ClientSession, engine: RunningEngine, **faults: Any) -> None:
    async with http.post(engine.url + "/sim/faults", json=faults) as response:
        assert response.status == 200, await response.text()


@contextlib.asynccontextmanager
async def engines(factory: EngineFactory, count: int, **overrides: Any
                  ) -> AsyncIterator[list[RunningEngine]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(factory(engine_id=str(i), **overrides))
               for i in range(count)]


@contextlib.asynccontextmanager
async def held_stream(http: aiohttp.ClientSession, url: str, body: Mapping[str, Any]
                      ) -> AsyncIterator[tuple[aiohttp.ClientResponse, bytes]]:
    """A streaming request whose first chunk has arrived; closed (abandoned) on exit."""
    response = await http.post(url + "/v1/chat/completions", json=body)
    try:
        assert response.status == 200, await response.text()
        yield response, await response.content.readany()
    finally:
        response.close()


def conversation(key: str, system_tokens: int, user_tokens: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": text_for(f"{key}-sys", system_tokens)},
            {"role": "user", "content": text_for(f"{key}-u0", user_tokens)}]


# -- sessions and placement ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["ttft", "cache_aware"])
async def test_a_session_stays_on_its_worker_and_hits_its_cache(
        engine_factory: EngineFactory, policy: str) -> None:
    reply_tokens = 24
    async with engines(engine_factory, 3) as fleet, \
            serve_router(router_config(fleet, policy=policy)) as router, \
            aiohttp.ClientSession() as http:
        messages = conversation("s", 300, 60)
        turns: list[Streamed] = []
        for turn in range(4):
            result = await post(http, router.url, chat_body(messages, reply_tokens))
            assert result.status == 200 and not result.errors
            turns.append(result)
            messages += [{"role": "assistant", "content": result.text},
                         {"role": "user", "content": text_for(f"s-u{turn + 1}", 40)}]
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
        engine_factory: EngineFactory) -> None:
    knobs = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.0}
    async with engines(engine_factory, 3) as fleet, \
            serve_router(router_config(fleet, policy="cache_aware", policy_knobs=knobs)
                         ) as router, aiohttp.ClientSession() as http:
        messages = conversation("busy", 200, 40)
        first = await post(http, router.url, chat_body(messages, 16))
        home = first.worker
        messages.append({"role": "assistant", "content": first.text})
        async with contextlib.AsyncExitStack() as holders:
            for i in range(3):  # loads 0, 1, 2 are balanced enough to follow the prefix
                body = chat_body([*messages, {"role": "user", "content": f"hold {i}"}],
                                 max_tokens=20_000)
                response, chunk = await holders.enter_async_context(
                    held_stream(http, router.url, body))
                assert response.headers[WORKER] == home and chunk.startswith(b"data: ")
            assert await metric(http, router, "kvrouter_worker_outstanding_requests",
                                worker=str(home)) == 3
            # 3 - 0 > 2 outstanding requests: the next turn goes to the least loaded.
            turn = await post(http, router.url, chat_body(
                [*messages, {"role": "user", "content": "next question"}], 8))
            assert turn.status == 200 and turn.worker != home
            assert turn.cached == 0  # the cost of leaving the cache behind
            decisions = await metric(http, router, "kvrouter_routing_decisions_total",
                                     policy="cache_aware", reason="load")
            assert decisions == 2  # the first turn (nothing cached) and the diverted one
        await assert_idle(http, router, wait_s=5.0)


async def test_ttft_diverts_a_session_from_a_worker_with_queued_prefill(
        engine_factory: EngineFactory) -> None:
    """A stalled worker's prefill queue grows; the session's next turn goes elsewhere.

    The conversation is too short to teach the router a prefill rate, so the workers'
    estimates differ only by their queues and caches.
    """
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet, policy="ttft")) as router, \
            aiohttp.ClientSession() as http:
        messages = conversation("queue", 100, 40)
        first = await post(http, router.url, chat_body(messages, 16))
        home = first.worker
        home_engine = fleet[int(str(home)[1:])]
        messages.append({"role": "assistant", "content": first.text})
        await set_faults(http, home_engine, stall=True)
        big = chat_body([*messages, {"role": "user", "content": text_for("big", 600)}], 1)
        holder = asyncio.create_task(post(http, router.url, big))

        async def queued() -> bool:
            return await metric(http, router, "kvrouter_worker_queued_prefill_tokens",
                                worker=str(home)) > 600

        await wait_for(queued)
        turn = await post(http, router.url, chat_body(
            [*messages, {"role": "user", "content": "and then?"}], 8))
        assert turn.status == 200 and turn.worker != home
        assert not holder.done()
        await set_faults(http, home_engine, stall=False)
        held = await asyncio.wait_for(holder, 10)
        assert held.status == 200 and held.worker == home  # the big turn followed the cache
        await assert_idle(http, router)


async def test_a_shared_system_prompt_spreads_under_ttft(engine_factory: EngineFactory
                                                         ) -> None:
    system = {"role": "system", "content": text_for("shared-sys", 1000)}
    async with engines(engine_factory, 3) as fleet, \
            serve_router(router_config(fleet, policy="ttft")) as router, \
            aiohttp.ClientSession() as http:
        results = await asyncio.gather(*(
            post(http, router.url, chat_body(
                [system, {"role": "user", "content": text_for(f"q{i}", 30)}], 4,
                stream=False))
            for i in range(12)))
        await assert_idle(http, router)
    assert all(r.status == 200 for r in results)
    spread = Counter(r.worker for r in results)
    assert len(spread) >= 2, spread


# -- byte-for-byte streaming ---------------------------------------------------------------

_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


async def test_a_stream_passes_through_byte_for_byte(engine_factory: EngineFactory) -> None:
    # A slow engine (~20 ms a step) sends each token in a chunk of its own, so the two
    # streams are framed alike; the sim's text is a function of the request's seed.
    body = chat_body(conversation("bytes", 50, 20), 10, seed=1234)
    async with engine_factory(time_scale=0.5) as engine, \
            serve_router(router_config([engine])) as router, aiohttp.ClientSession() as http:
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
    + 'data: {"id":"x","choices":[{"index":0,"delta":{"content":"h\u00e9llo \u2713"}}]}\r\n\r\n'
    .encode()
    + b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
    b'"prompt_tokens_details":{"cached_tokens":7}}}\n\ndata: [DONE]\n\n'
)
_ODD_CUTS = (3, 17, 90, 91, 140, 141, 142, 160, 161, 200, len(_ODD_BODY))


async def _odd_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "X-Engine-Header": "kept"})
    await response.prepare(request)
    start = 0
    for end in _ODD_CUTS:
        await response.write(_ODD_BODY[start:end])
        start = end
        await asyncio.sleep(0.005)
    await response.write_eof()
    return response


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def fake_engine(chat: Handler) -> AsyncIterator[str]:
    """A stand-in engine whose chat endpoint is ``chat``; health and models answer."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": TEST_MODEL}]})

    app = web.Application()
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_odd_chunking_passes_through_byte_for_byte() -> None:
    async with fake_engine(_odd_stream) as url:
        config = router_config([], workers=(WorkerConfig(url, name="fake", kv_tokens=10_000),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            async with http.post(router.url + "/v1/chat/completions",
                                 json=chat_body([{"role": "user", "content": "hi"}])
                                 ) as response:
                raw = await response.read()
                assert response.headers["X-Engine-Header"] == "kept"
                assert response.headers[WORKER] == "fake"
            assert raw == _ODD_BODY
            assert await metric(http, router, "kvrouter_engine_cached_tokens_total") == 7
            await assert_idle(http, router)


# -- load accounting on every exit ---------------------------------------------------------


async def test_load_returns_to_zero_after_successes(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet, policy="least_load")) as router, \
            aiohttp.ClientSession() as http:
        bodies = [chat_body(conversation(f"ok{i}", 80, 20), 6, stream=i % 2 == 0)
                  for i in range(6)]
        results = await asyncio.gather(*(post(http, router.url, b) for b in bodies),
                                       post(http, router.url, {"model": TEST_MODEL,
                                                               "prompt": [1, 2, 3],
                                                               "max_tokens": 3},
                                            path="/v1/completions"))
        assert [r.status for r in results] == [200] * 7
        await assert_idle(http, router)
        assert await metric(http, router, "kvrouter_requests_total", outcome="success") == 7


async def test_load_returns_to_zero_after_upstream_errors(engine_factory: EngineFactory
                                                          ) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet)) as router, aiohttp.ClientSession() as http:
        for engine in fleet:
            await set_faults(http, engine, fail_requests=True)
        results = await asyncio.gather(*(
            post(http, router.url, chat_body(conversation(f"e{i}", 50, 10), stream=i == 0))
            for i in range(3)))
        assert [r.status for r in results] == [500] * 3
        await assert_idle(http, router)


async def test_load_returns_to_zero_after_a_client_disconnect(engine_factory: EngineFactory
                                                              ) -> None:
    async with engines(engine_factory, 1) as fleet, \
            serve_router(router_config(fleet)) as router, aiohttp.ClientSession() as http:
        body = chat_body(conversation("gone", 80, 20), max_tokens=20_000)
        async with held_stream(http, router.url, body) as (_, first):
            assert first.startswith(b"data: ")
            assert await metric(http, router, "kvrouter_worker_outstanding_requests") == 1
        await assert_idle(http, router, wait_s=5.0)

        async def engine_idle() -> bool:  # the router cancelled the upstream request too
            async with http.get(fleet[0].url + "/metrics") as response:
                text = await response.text()
            return all(s.value == 0 for f in text_string_to_metric_families(text)
                       for s in f.samples if s.name == "vllm:num_requests_running")

        await wait_for(engine_idle)
        assert await metric(http, router, "kvrouter_requests_total",
                            outcome="client_disconnect") == 1

        # Gone before the first byte: the engine hangs, the client gives up waiting.
        await set_faults(http, fleet[0], stall=True)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(http, router.url, body), 0.3)
        await assert_idle(http, router, wait_s=5.0)
        assert await metric(http, router, "kvrouter_requests_total",
                            outcome="client_disconnect") == 2
        await set_faults(http, fleet[0], stall=False)


async def test_load_returns_to_zero_after_timeouts(engine_factory: EngineFactory) -> None:
    config_up = UpstreamConfig(read_timeout_s=0.5)
    async with engines(engine_factory, 1) as fleet, \
            serve_router(router_config(fleet, upstream=config_up)) as router, \
            aiohttp.ClientSession() as http:
        engine = fleet[0]
        # Mid-stream: the first chunk is through, then the engine hangs.
        body = chat_body(conversation("slow", 80, 20), max_tokens=20_000)
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            await response.content.readany()
            await set_faults(http, engine, stall=True)
            started = time.monotonic()
            rest = await response.read()
            assert time.monotonic() - started < 3
        _, _, errors = parse_sse(rest)
        assert len(errors) == 1 and "mid-stream" in errors[0]["message"]
        await assert_idle(http, router)
        assert await metric(http, router, "kvrouter_requests_total", outcome="timeout") == 1
        # Before the first byte, streaming or not: the router answers with an error.
        for stream in (True, False):
            started = time.monotonic()
            result = await post(http, router.url,
                                chat_body(conversation("slow2", 50, 10), stream=stream))
            assert result.status == 504 and time.monotonic() - started < 3
            error = orjson.loads(result.raw)["error"]
            assert error["type"] == "server_error" and error["code"] == result.status
            await assert_idle(http, router)
        await set_faults(http, engine, stall=False)


# -- retries -------------------------------------------------------------------------------


async def test_a_failing_worker_is_retried_on_another(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet, policy="round_robin")) as router, \
            aiohttp.ClientSession() as http:
        await set_faults(http, fleet[0], fail_requests=True)
        results = [await post(http, router.url, chat_body(conversation(f"r{i}", 50, 10),
                                                          stream=i % 2 == 0))
                   for i in range(4)]
        assert [(r.status, r.worker) for r in results] == [(200, "w1")] * 4
        # Round robin offers w0 first every time (the retry takes w1's turn).
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 4
        assert await metric(http, router, "kvrouter_retries_total", worker="w1") == 0
        await assert_idle(http, router)


async def test_a_timed_out_worker_is_retried_on_another(engine_factory: EngineFactory) -> None:
    config_up = UpstreamConfig(read_timeout_s=0.5)
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet, policy="round_robin", upstream=config_up)
                         ) as router, aiohttp.ClientSession() as http:
        await set_faults(http, fleet[0], stall=True)
        started = time.monotonic()
        result = await post(http, router.url, chat_body(conversation("t", 50, 10)))
        assert (result.status, result.worker) == (200, "w1") and not result.errors
        assert time.monotonic() - started < 3
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
        await assert_idle(http, router)
        await set_faults(http, fleet[0], stall=False)


async def _error_that_hangs(request: web.Request) -> web.StreamResponse:
    """A 500 whose body never finishes."""
    response = web.StreamResponse(status=500, headers={"Content-Type": "application/json",
                                                       "Content-Length": "1000"})
    await response.prepare(request)
    await response.write(b'{"error": ')
    await asyncio.sleep(30)
    return response


async def test_an_error_whose_body_hangs_is_retried(engine_factory: EngineFactory) -> None:
    async with fake_engine(_error_that_hangs) as url, engine_factory() as engine:
        config = router_config([engine], policy="round_robin",
                               upstream=UpstreamConfig(read_timeout_s=0.5),
                               workers=(WorkerConfig(url, name="w0", kv_tokens=10_000),
                                        WorkerConfig(engine.url, name="w1")))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            result = await post(http, router.url, chat_body(conversation("h", 50, 10)))
            assert (result.status, result.worker) == (200, "w1")
            assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
            await assert_idle(http, router)


_SPLIT_JSON = orjson.dumps({"id": "x", "object": "chat.completion", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "word " * 2000},
     "finish_reason": "length"}], "usage": {"prompt_tokens": 5, "completion_tokens": 2000,
                                            "prompt_tokens_details": {"cached_tokens": 0}}})


async def _json_in_two_writes(request: web.Request) -> web.StreamResponse:
    """A whole (non-streamed) response whose second half comes a moment later."""
    status = 500 if request.headers.get("X-Fail") else 200
    response = web.StreamResponse(status=status, headers={
        "Content-Type": "application/json", "Content-Length": str(len(_SPLIT_JSON))})
    await response.prepare(request)
    half = len(_SPLIT_JSON) // 2
    await response.write(_SPLIT_JSON[:half])
    await asyncio.sleep(0.05)
    await response.write(_SPLIT_JSON[half:])
    await response.write_eof()
    return response


async def test_whole_responses_are_passed_on_whole() -> None:
    async with fake_engine(_json_in_two_writes) as url:
        config = router_config([], workers=(WorkerConfig(url, name="w0", kv_tokens=10_000),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            body = chat_body([{"role": "user", "content": "hi"}], stream=False)
            for headers in ({}, {"X-Fail": "1"}):  # a success, and an error passed on
                async with http.post(router.url + "/v1/chat/completions", json=body,
                                     headers=headers) as response:
                    assert response.status == (500 if headers else 200)
                    assert await response.read() == _SPLIT_JSON
            await assert_idle(http, router)


async def test_when_every_worker_fails_the_client_gets_the_upstream_error(
        engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet)) as router, aiohttp.ClientSession() as http:
        for engine in fleet:
            await set_faults(http, engine, fail_requests=True, fail_status=503)
        body = chat_body(conversation("all", 50, 10))
        routed = await post(http, router.url, body)
        direct = await post(http, fleet[0].url, body)
        assert routed.status == direct.status == 503
        assert orjson.loads(routed.raw) == orjson.loads(direct.raw) == {"error": {
            "message": "simulated engine failure (fault injected)",
            "type": "ServiceUnavailableError", "param": None, "code": 503}}
        # Two attempts, so one retry: the last failure has nowhere left to go.
        assert await metric(http, router, "kvrouter_retries_total") == 1
        await assert_idle(http, router)


async def test_a_closed_port_is_retried_never_hangs(engine_factory: EngineFactory) -> None:
    async with contextlib.AsyncExitStack() as first_engine, \
            engine_factory(engine_id="1") as survivor:
        doomed = await first_engine.enter_async_context(engine_factory(engine_id="0"))
        async with serve_router(router_config([doomed, survivor], policy="round_robin")
                                ) as router, aiohttp.ClientSession() as http:
            await first_engine.aclose()  # w0's port is closed; the router has not noticed
            for stream in (True, False):
                result = await asyncio.wait_for(
                    post(http, router.url, chat_body(conversation("c", 50, 10), stream=stream)),
                    5)
                assert (result.status, result.worker) == (200, "w1")
            # The refused connection took w0 out of rotation at once: one retry, not two.
            assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
            async with http.get(router.url + "/ready") as response:
                assert (await response.json())["healthy_workers"] == ["w1"]
            await assert_idle(http, router)


# -- bad requests --------------------------------------------------------------------------

_GOOD = {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}],
         "max_tokens": 2}
_BAD: Sequence[tuple[str, bytes, int, str]] = [
    ("malformed json", b'{"model": "sim-model", "messages": [', 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error"),
    ("missing messages", orjson.dumps({"model": TEST_MODEL}), 400, "invalid_request_error"),
    ("empty messages", orjson.dumps({**_GOOD, "messages": []}), 400, "invalid_request_error"),
    ("messages a string", orjson.dumps({**_GOOD, "messages": "hi"}), 400,
     "invalid_request_error"),
    ("role a number", orjson.dumps({**_GOOD, "messages": [{"role": 1, "content": "x"}]}), 400,
     "invalid_request_error"),
    ("content a number", orjson.dumps({**_GOOD, "messages": [{"role": "user",
                                                              "content": 5}]}), 400,
     "invalid_request_error"),
    ("stream a string", orjson.dumps({**_GOOD, "stream": "yes"}), 400,
     "invalid_request_error"),
    ("model a number", orjson.dumps({**_GOOD, "model": 5}), 400, "invalid_request_error"),
    ("unknown model", orjson.dumps({**_GOOD, "model": "gpt-9"}), 404,
     "invalid_request_error"),
    ("too large", orjson.dumps({**_GOOD, "messages": [{"role": "user",
                                                       "content": "x" * 4000}]}), 413,
     "invalid_request_error"),
]


async def test_bad_requests_get_openai_errors_and_the_router_still_serves(
        engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 1) as fleet, \
            serve_router(router_config(fleet, max_body_bytes=2048)) as router, \
            aiohttp.ClientSession() as http:
        statuses: Counter[str] = Counter()
        for name, raw, status, error_type in _BAD:
            async with http.post(router.url + "/v1/chat/completions", data=raw,
                                 headers={"Content-Type": "application/json"}) as response:
                assert response.status == status, name
                error = (await response.json())["error"]
            assert isinstance(error["message"], str) and error["message"], name
            assert error["type"] == error_type, name
            assert error["code"] == ("model_not_found" if status == 404 else status), name
            statuses[str(status)] += 1

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: read, then refused
            for _ in range(8):
                yield b" " * 512
        async with http.post(router.url + "/v1/chat/completions", data=chunks()) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == 413
        statuses["413"] += 1
        async with http.post(router.url + "/v1/completions",
                             json={"model": TEST_MODEL, "prompt": [True]}) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "prompt"
        statuses["400"] += 1
        async with http.get(router.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert (await response.json())["error"]["code"] == 405
        for code, count in statuses.items():
            assert await metric(http, router, "kvrouter_rejected_requests_total",
                                status=code) == count, code
        result = await post(http, router.url, chat_body(conversation("fine", 20, 5)))
        assert result.status == 200 and len(result.text) == 8 * 4
        await assert_idle(http, router)


# -- every policy, models, health ----------------------------------------------------------


@pytest.mark.parametrize("policy", policy_names())
async def test_every_policy_serves(engine_factory: EngineFactory, policy: str) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet, policy=policy)) as router, \
            aiohttp.ClientSession() as http:
        session = conversation("p", 100, 20)
        results = [await post(http, router.url, chat_body(session, 4, stream=i % 2 == 0,
                                                          user="u1"))
                   for i in range(3)]
        results.append(await post(http, router.url, {"model": TEST_MODEL, "prompt": "x" * 300,
                                                     "max_tokens": 3, "stream": True},
                                  path="/v1/completions"))
        assert [r.status for r in results] == [200] * 4
        assert all(r.worker in ("w0", "w1") for r in results)
        assert await metric(http, router, "kvrouter_routing_decisions_total",
                            policy=policy) == 4
        await assert_idle(http, router)


async def test_models_health_and_readiness(engine_factory: EngineFactory) -> None:
    health = HealthConfig(interval_s=0.1, timeout_s=0.5)
    async with contextlib.AsyncExitStack() as stack:
        a = await stack.enter_async_context(engine_factory(served_model_name="model-a"))
        b = await stack.enter_async_context(engine_factory(served_model_name="model-b"))
        async with serve_router(router_config([a, b], health=health)) as router, \
                aiohttp.ClientSession() as http:
            async with http.get(router.url + "/v1/models") as response:
                listed = await response.json()
            assert listed["object"] == "list"
            assert [m["id"] for m in listed["data"]] == ["model-a", "model-b"]
            for model, worker in (("model-a", "w0"), ("model-b", "w1"), ("model-b", "w1")):
                result = await post(http, router.url, {**chat_body(
                    conversation("m", 20, 5), 2), "model": model})
                assert (result.status, result.worker) == (200, worker)
            assert (await post(http, router.url, {**chat_body(conversation("m", 20, 5)),
                                                  "model": "model-c"})).status == 404
            async with http.get(router.url + "/health") as response:
                assert response.status == 200
                assert (await response.json())["status"] == "ok"
            async with http.get(router.url + "/ready") as response:
                assert response.status == 200
                assert await response.json() == {"ready": True,
                                                  "healthy_workers": ["w0", "w1"]}

            await stack.aclose()  # every engine goes down

            async def not_ready() -> bool:
                async with http.get(router.url + "/ready") as response:
                    return response.status == 503
            await wait_for(not_ready)
            async with http.get(router.url + "/ready") as response:
                assert await response.json() == {"ready": False, "healthy_workers": []}
            result = await post(http, router.url, {**chat_body(conversation("m", 20, 5)),
                                                   "model": "model-a"})
            assert result.status == 503
            assert orjson.loads(result.raw)["error"]["type"] == "server_error"
            async with http.get(router.url + "/health") as response:
                assert response.status == 200
            await assert_idle(http, router)


async def test_the_openai_client_streams_through_the_router(engine_factory: EngineFactory
                                                            ) -> None:
    async with engines(engine_factory, 2) as fleet, \
            serve_router(router_config(fleet)) as router:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="unused",
                                    max_retries=0)
        try:
            messages: Any = conversation("oa", 200, 30)
            usages = []
            for _ in range(2):
                stream = await client.chat.completions.create(
                    model=TEST_MODEL, messages=messages, max_tokens=10, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
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
