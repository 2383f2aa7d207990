"""The router when things go wrong: load accounting on every exit, retries before the
first byte, what a refused or broken dispatch leaves behind; real HTTP over loopback to
simulated engines and stand-in workers. Bad requests are in test_hostile_input, what
crosses between clients and engines in test_boundaries."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from bench.loopback import serve_on_loopback
from router.config import HealthConfig, UpstreamConfig, WorkerConfig
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    router_config,
    serve_router,
)
from tests.router_client import (
    Handler,
    assert_idle,
    chat_body,
    conversation,
    engines,
    fake_engine,
    held_stream,
    load,
    metric,
    parse_sse,
    post,
    set_faults,
    wait_for,
)

# -- load accounting on every exit ---------------------------------------------------------


async def test_load_returns_to_zero_after_successes(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="least_load")) as router,
        aiohttp.ClientSession() as http,
    ):
        bodies = [chat_body(conversation(f"ok{i}", 80, 20), 6, stream=i % 2 == 0) for i in range(6)]
        results = await asyncio.gather(
            *(post(http, router.url, b) for b in bodies),
            post(
                http,
                router.url,
                {"model": TEST_MODEL, "prompt": [1, 2, 3], "max_tokens": 3},
                path="/v1/completions",
            ),
        )
        assert [r.status for r in results] == [200] * 7
        await assert_idle(http, router)
        assert await metric(http, router, "kvrouter_requests_total", outcome="success") == 7


async def test_load_returns_to_zero_after_upstream_errors(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        for engine in fleet:
            await set_faults(http, engine, fail_requests=True)
        results = await asyncio.gather(
            *(
                post(http, router.url, chat_body(conversation(f"e{i}", 50, 10), stream=i == 0))
                for i in range(3)
            )
        )
        assert [r.status for r in results] == [500] * 3
        await assert_idle(http, router)


async def test_load_returns_to_zero_after_a_client_disconnect(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body(conversation("gone", 80, 20), max_tokens=20_000)
        async with held_stream(http, router.url, body) as (_, first):
            assert first.startswith(b"data: ")
            assert await metric(http, router, "kvrouter_worker_outstanding_requests") == 1
        await assert_idle(http, router, wait_s=5.0)

        async def engine_idle() -> bool:  # the router cancelled the upstream request too
            async with http.get(fleet[0].url + "/metrics") as response:
                text = await response.text()
            return all(
                s.value == 0
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "vllm:num_requests_running"
            )

        await wait_for(engine_idle)
        assert (
            await metric(http, router, "kvrouter_requests_total", outcome="client_disconnect") == 1
        )

        # Gone before the first byte: the engine hangs, the client gives up waiting.
        await set_faults(http, fleet[0], stall=True)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(post(http, router.url, body), 0.3)
        await assert_idle(http, router, wait_s=5.0)
        assert (
            await metric(http, router, "kvrouter_requests_total", outcome="client_disconnect") == 2
        )
        await set_faults(http, fleet[0], stall=False)


async def test_load_returns_to_zero_after_timeouts(engine_factory: EngineFactory) -> None:
    config_up = UpstreamConfig(read_timeout_s=0.5)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, upstream=config_up)) as router,
        aiohttp.ClientSession() as http,
    ):
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
            result = await post(
                http, router.url, chat_body(conversation("slow2", 50, 10), stream=stream)
            )
            assert result.status == 504 and time.monotonic() - started < 3
            error = orjson.loads(result.raw)["error"]
            assert error["type"] == "server_error" and error["code"] == result.status
            await assert_idle(http, router)
        await set_faults(http, engine, stall=False)


# -- retries -------------------------------------------------------------------------------


async def test_a_failing_worker_is_retried_on_another(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="round_robin")) as router,
        aiohttp.ClientSession() as http,
    ):
        await set_faults(http, fleet[0], fail_requests=True)
        results = [
            await post(
                http, router.url, chat_body(conversation(f"r{i}", 50, 10), stream=i % 2 == 0)
            )
            for i in range(4)
        ]
        assert [(r.status, r.worker) for r in results] == [(200, "w1")] * 4
        # Round robin offers w0 first every time (the retry takes w1's turn).
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 4
        assert await metric(http, router, "kvrouter_retries_total", worker="w1") == 0
        await assert_idle(http, router)


async def test_a_timed_out_worker_is_retried_on_another(engine_factory: EngineFactory) -> None:
    config_up = UpstreamConfig(read_timeout_s=0.5)
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, policy="round_robin", upstream=config_up)) as router,
        aiohttp.ClientSession() as http,
    ):
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
    response = web.StreamResponse(
        status=500, headers={"Content-Type": "application/json", "Content-Length": "1000"}
    )
    await response.prepare(request)
    await response.write(b'{"error": ')
    await asyncio.sleep(30)
    return response


async def test_an_error_whose_body_hangs_is_retried(engine_factory: EngineFactory) -> None:
    async with fake_engine(_error_that_hangs) as url, engine_factory() as engine:
        config = router_config(
            [engine],
            policy="round_robin",
            upstream=UpstreamConfig(read_timeout_s=0.5),
            workers=(
                WorkerConfig(url, name="w0", kv_tokens=10_000),
                WorkerConfig(engine.url, name="w1"),
            ),
        )
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            result = await post(http, router.url, chat_body(conversation("h", 50, 10)))
            assert (result.status, result.worker) == (200, "w1")
            assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
            await assert_idle(http, router)


_SPLIT_JSON = orjson.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "word " * 2000},
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2000,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
)


async def _json_in_two_writes(request: web.Request) -> web.StreamResponse:
    """A whole (non-streamed) response whose second half comes a moment later."""
    status = 500 if (await request.json()).get("user") == "fail" else 200
    response = web.StreamResponse(
        status=status,
        headers={"Content-Type": "application/json", "Content-Length": str(len(_SPLIT_JSON))},
    )
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
            for user in ("fine", "fail"):  # a success, and an error passed on
                body = chat_body([{"role": "user", "content": "hi"}], stream=False, user=user)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == (500 if user == "fail" else 200)
                    assert await response.read() == _SPLIT_JSON
            await assert_idle(http, router)


async def test_when_every_worker_fails_the_client_gets_the_upstream_error(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        for engine in fleet:
            await set_faults(http, engine, fail_requests=True, fail_status=503)
        body = chat_body(conversation("all", 50, 10))
        routed = await post(http, router.url, body)
        direct = await post(http, fleet[0].url, body)
        assert routed.status == direct.status == 503
        assert (
            orjson.loads(routed.raw)
            == orjson.loads(direct.raw)
            == {
                "error": {
                    "message": "simulated engine failure (fault injected)",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": 503,
                }
            }
        )
        # Two attempts, so one retry: the last failure has nowhere left to go.
        assert await metric(http, router, "kvrouter_retries_total") == 1
        await assert_idle(http, router)


async def test_a_closed_port_is_retried_never_hangs(engine_factory: EngineFactory) -> None:
    async with (
        contextlib.AsyncExitStack() as first_engine,
        engine_factory(engine_id="1") as survivor,
    ):
        doomed = await first_engine.enter_async_context(engine_factory(engine_id="0"))
        async with (
            serve_router(router_config([doomed, survivor], policy="round_robin")) as router,
            aiohttp.ClientSession() as http,
        ):
            await first_engine.aclose()  # w0's port is closed; the router has not noticed
            for stream in (True, False):
                result = await asyncio.wait_for(
                    post(http, router.url, chat_body(conversation("c", 50, 10), stream=stream)), 5
                )
                assert (result.status, result.worker) == (200, "w1")
            # The refused connection took w0 out of rotation at once: one retry, not two.
            assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
            async with http.get(router.url + "/ready") as response:
                assert (await response.json())["healthy_workers"] == ["w1"]
            await assert_idle(http, router)


async def test_no_retry_starts_after_the_retry_deadline(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 2) as fleet, aiohttp.ClientSession() as http:
        upstream = UpstreamConfig(read_timeout_s=0.3, retry_deadline_s=0.1, max_attempts=2)
        config = router_config(fleet, policy="round_robin", upstream=upstream)
        async with serve_router(config) as router:
            for engine in fleet:
                await set_faults(http, engine, stall=True)
            result = await post(http, router.url, chat_body(conversation("late", 50, 10)))
            # The first attempt timed out after 0.3 s, past the 0.1 s deadline: no retry.
            assert result.status == 504
            assert await metric(http, router, "kvrouter_retries_total") == 0


async def test_a_rejected_prompt_leaves_the_cache_model_as_it_was(
    engine_factory: EngineFactory,
) -> None:
    """A prompt the engine refuses (longer than its context) computed nothing: the blocks
    recorded for it at dispatch must not push out what the worker really holds."""
    async with (
        engine_factory(kv_tokens=20_000, max_model_len=8_192) as sim,
        serve_router(router_config([sim])) as router,
        aiohttp.ClientSession() as http,
    ):
        history = conversation("kept", 3_000, 200)
        first = await post(http, router.url, chat_body(history))
        assert first.status == 200
        huge = chat_body(conversation("refused", 60_000, 200))
        async with http.post(router.url + "/v1/chat/completions", json=huge) as response:
            assert response.status == 400
        before = await metric(http, router, "kvrouter_predicted_cached_tokens_total")
        history += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "and then?"},
        ]
        assert (await post(http, router.url, chat_body(history))).status == 200
        predicted = await metric(http, router, "kvrouter_predicted_cached_tokens_total")
        assert predicted - before >= 3_000
        await assert_idle(http, router)


async def test_a_non_streamed_request_stops_counting_as_queued_prefill_once_prefilled(
    engine_factory: EngineFactory,
) -> None:
    """A non-streamed reply arrives whole, long after the prefill ended; the router
    must not show its prompt as queued prefill (which ``ttft`` reads as a queue) while
    the engine decodes."""
    async with (
        engine_factory(time_scale=2.0) as sim,
        serve_router(router_config([sim])) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body(conversation("whole", 2_000, 100), max_tokens=200, stream=False)
        reply = asyncio.create_task(post(http, router.url, body))

        async def prefilled_while_decoding() -> bool:
            gauges = await load(http, router)
            return (
                gauges["kvrouter_worker_outstanding_requests{w0}"] == 1
                and gauges["kvrouter_worker_queued_prefill_tokens{w0}"] == 0
            )

        await wait_for(prefilled_while_decoding)
        assert not reply.done()
        assert (await reply).status == 200
        await assert_idle(http, router)


_FIRST_EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk",'
    b'"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
)


async def _dies_mid_event(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(_FIRST_EVENT)
    await response.write(b'data: {"id":"c","object":"chat.compl')
    assert request.transport is not None
    request.transport.abort()  # the worker dies with half an event sent
    return response


async def test_a_worker_that_dies_mid_event_leaves_a_parseable_stream() -> None:
    async with (
        fake_engine(_dies_mid_event) as url,
        serve_router(router_config([], workers=(WorkerConfig(url, name="w0"),))) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body(conversation("cut", 20, 5))
        async with http.post(router.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            raw = await response.read()
        assert raw.startswith(_FIRST_EVENT)
        events = [e for e in raw.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events)
        text, _, errors = parse_sse(raw)  # every event is whole JSON
        assert text == "Hi" and len(errors) == 1
        assert url.split("//")[1] not in errors[0]["message"]  # no worker address
        assert "w0" not in errors[0]["message"]


async def _never_answers(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()  # answers /health, hangs on every request
    raise AssertionError


async def _endless_head(request: web.Request) -> web.StreamResponse:
    transport = request.transport
    assert transport is not None
    transport.write(b"HTTP/1.1 200 OK\r\n")
    while not transport.is_closing():  # headers, until the router hangs up
        transport.write(b"X-Filler: a header that never ends the head\r\n" * 20)
        await asyncio.sleep(0.001)
    raise ConnectionResetError


@pytest.mark.parametrize(
    ("bad", "upstream"),
    [
        (_never_answers, UpstreamConfig(first_byte_timeout_s=0.3)),
        (_endless_head, UpstreamConfig()),  # cut off at the head's limit, not by a timeout
    ],
    ids=["sends-nothing", "head-never-ends"],
)
async def test_a_worker_that_never_answers_properly_is_retried_on_another(
    engine_factory: EngineFactory, bad: Handler, upstream: UpstreamConfig
) -> None:
    async with (
        fake_engine(bad) as hung,
        engine_factory() as sim,
        serve_router(
            router_config(
                [],
                policy="round_robin",
                upstream=upstream,
                workers=(WorkerConfig(hung, name="w0"), WorkerConfig(sim.url, name="w1")),
            )
        ) as router,
        aiohttp.ClientSession() as http,
    ):
        for _ in range(2):  # round robin: at least one lands on the bad worker first
            result = await post(http, router.url, chat_body(conversation("fb", 20, 5)))
            assert result.status == 200 and result.worker == "w1"
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") >= 1
        assert await metric(http, router, "kvrouter_requests_total", outcome="success") == 2
        await assert_idle(http, router)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_that_fails_its_probe_gives_up_its_unanswered_requests(
    engine_factory: EngineFactory, stream: bool
) -> None:
    # Found by the soak: a whole reply has no first-byte bound, only read_timeout_s
    # (600 s), longer than the retry deadline, so a request on a worker that hung was
    # answered 504 after ten minutes while another worker could have served it.
    received, failing = asyncio.Event(), asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if failing.is_set() else 200)

    async def hang(request: web.Request) -> web.StreamResponse:
        received.set()
        await asyncio.Event().wait()
        raise AssertionError

    async def metrics(request: web.Request) -> web.Response:  # fresh and idle: eligible
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    hung_app = web.Application()
    hung_app.router.add_get("/health", health)
    hung_app.router.add_get("/metrics", metrics)
    hung_app.router.add_post("/v1/chat/completions", hang)
    async with (
        serve_on_loopback(hung_app) as hung,
        engine_factory() as sim,
        serve_router(
            router_config(
                [],
                policy="round_robin",  # one of the first two requests goes to w0
                workers=(WorkerConfig(hung, name="w0"), WorkerConfig(sim.url, name="w1")),
            )
        ) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body(conversation("probe", 20, 5), stream=stream)
        for _ in range(2):
            sent = asyncio.create_task(post(http, router.url, body))
            arrived = asyncio.create_task(received.wait())
            await asyncio.wait({sent, arrived}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
            if received.is_set():
                break
            arrived.cancel()
            assert (await sent).worker == "w1"
        assert received.is_set()
        failing.set()
        await router.state.prober.probe_all()  # the next health round
        result = await asyncio.wait_for(sent, 10)  # a safety bound: without the fix, 60-600 s
        assert result.status == 200 and result.worker == "w1"
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") == 1
        await assert_idle(http, router)


async def test_waiting_for_a_pooled_connection_is_not_the_workers_failure(
    engine_factory: EngineFactory,
) -> None:
    upstream = UpstreamConfig(connect_timeout_s=0.2, max_connections_per_worker=1)
    health = HealthConfig(interval_s=60, failure_threshold=1)
    async with (
        engine_factory(time_scale=2.0) as sim,
        serve_router(router_config([sim], upstream=upstream, health=health)) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body(conversation("pool", 20, 5), max_tokens=60)  # ~0.5 s each
        results = await asyncio.gather(*(post(http, router.url, body) for _ in range(3)))
        assert [r.status for r in results] == [200, 200, 200]
        assert await metric(http, router, "kvrouter_requests_total", outcome="timeout") == 0
        assert (await post(http, router.url, body)).status == 200  # the circuit stayed shut


def _usage_reply(cached: int) -> bytes:
    return orjson.dumps(
        {
            "id": "c",
            "object": "chat.completion",
            "model": TEST_MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hi"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": 1,
                "total_tokens": 11,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )


async def _absurd_usage(request: web.Request) -> web.Response:
    body = await request.json()
    cached = {"negative": -(2**63), "huge": 2**63, "over": 11, "fine": 5}[body["user"]]
    return web.Response(body=_usage_reply(cached), content_type="application/json")


async def test_usage_that_is_no_token_count_is_taken_as_unknown_and_counted() -> None:
    async with fake_engine(_absurd_usage) as url:
        config = router_config([], workers=(WorkerConfig(url, name="w0", kv_tokens=10_000),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            for user in ("negative", "huge", "over", "fine"):  # one keep-alive connection
                body = chat_body([{"role": "user", "content": "hi"}], stream=False, user=user)
                async with http.post(router.url + "/v1/chat/completions", json=body) as response:
                    assert response.status == 200
                    assert response.headers.get("Connection", "").lower() != "close"
                    await response.read()
            assert (
                await metric(http, router, "kvrouter_engine_usage_rejected_total", worker="w0") == 3
            )
            assert (
                await metric(http, router, "kvrouter_engine_cached_tokens_total", worker="w0") == 5
            )
            assert await metric(http, router, "kvrouter_requests_total", outcome="success") == 4
            await assert_idle(http, router)
