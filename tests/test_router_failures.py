"""The router when things go wrong: load accounting on every exit, retries before the
first byte, and bad requests; real HTTP over loopback to simulated engines."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from policies.base import Decision, RouteRequest, WorkerView
from policies.round_robin import RoundRobinPolicy
from router.config import HealthConfig, UpstreamConfig, WorkerConfig
from router.policy_slot import ActivePolicy
from router.state import STATE_KEY
from tests.conftest import (
    TEST_MODEL,
    EngineFactory,
    router_config,
    serve_router,
)
from tests.router_client import (
    WORKER,
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
    router_samples,
    set_faults,
    wait_for,
    whole_reply,
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


# -- bad requests --------------------------------------------------------------------------

_GOOD = {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
_BAD: Sequence[tuple[str, bytes, int, str]] = [
    ("malformed json", b'{"model": "sim-model", "messages": [', 400, "invalid_request_error"),
    ("not an object", b"[1, 2]", 400, "invalid_request_error"),
    ("missing messages", orjson.dumps({"model": TEST_MODEL}), 400, "invalid_request_error"),
    ("empty messages", orjson.dumps({**_GOOD, "messages": []}), 400, "invalid_request_error"),
    ("messages a string", orjson.dumps({**_GOOD, "messages": "hi"}), 400, "invalid_request_error"),
    (
        "role a number",
        orjson.dumps({**_GOOD, "messages": [{"role": 1, "content": "x"}]}),
        400,
        "invalid_request_error",
    ),
    (
        "content a number",
        orjson.dumps({**_GOOD, "messages": [{"role": "user", "content": 5}]}),
        400,
        "invalid_request_error",
    ),
    ("stream a string", orjson.dumps({**_GOOD, "stream": "yes"}), 400, "invalid_request_error"),
    ("model a number", orjson.dumps({**_GOOD, "model": 5}), 400, "invalid_request_error"),
    ("unknown model", orjson.dumps({**_GOOD, "model": "gpt-9"}), 404, "invalid_request_error"),
    (
        "too large",
        orjson.dumps({**_GOOD, "messages": [{"role": "user", "content": "x" * 4000}]}),
        413,
        "invalid_request_error",
    ),
]


async def test_bad_requests_get_openai_errors_and_the_router_still_serves(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, max_body_bytes=2048)) as router,
        aiohttp.ClientSession() as http,
    ):
        statuses: Counter[str] = Counter()
        for name, raw, status, error_type in _BAD:
            async with http.post(
                router.url + "/v1/chat/completions",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as response:
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
        async with http.post(
            router.url + "/v1/completions", json={"model": TEST_MODEL, "prompt": [True]}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "prompt"
        statuses["400"] += 1
        async with http.get(router.url + "/v1/chat/completions") as response:
            assert response.status == 405
            assert (await response.json())["error"]["code"] == 405
        for code, count in statuses.items():
            assert (
                await metric(http, router, "kvrouter_rejected_requests_total", status=code) == count
            ), code
        result = await post(http, router.url, chat_body(conversation("fine", 20, 5)))
        assert result.status == 200 and len(result.text) == 8 * 4
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


async def test_api_keys_guard_the_openai_routes(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet, api_keys=("key-one", "key-two"))) as router,
        aiohttp.ClientSession() as http,
    ):
        body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
        for headers, status in (
            ({}, 401),
            ({"Authorization": "Bearer nope"}, 401),
            ({"Authorization": "Bearer key-two"}, 200),
        ):
            async with http.post(
                router.url + "/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status == status
                if status == 401:
                    assert (await response.json())["error"]["code"] == "invalid_api_key"
        async with http.get(router.url + "/health") as response:
            assert response.status == 200  # probes need no key


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


def _engine_without_model_list() -> contextlib.AbstractAsyncContextManager[str]:
    """A worker whose /v1/models refuses the router (as vLLM with --api-key does)."""

    async def chat(request: web.Request) -> web.Response:
        return whole_reply()

    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"error": "Unauthorized"}, status=401)

    return fake_engine(chat, models=refused)


async def test_client_chosen_models_never_become_metric_labels(
    engine_factory: EngineFactory,
) -> None:
    async with (
        _engine_without_model_list() as url,
        serve_router(router_config([], workers=(WorkerConfig(url, name="w0"),))) as router,
        aiohttp.ClientSession() as http,
    ):
        for i in range(30):  # no model list known: every model is passed on
            body = {**chat_body(conversation("m", 10, 5), stream=False), "model": f"junk-{i}"}
            assert (await post(http, router.url, body)).status == 200
        models = {
            labels["model"]
            for name, labels, _ in await router_samples(http, router)
            if name == "kvrouter_requests_total"
        }
        assert models == {"other"}
    async with (
        engine_factory() as sim,
        _engine_without_model_list() as url,
        serve_router(
            router_config(
                [sim], workers=(WorkerConfig(sim.url, name="w0"), WorkerConfig(url, name="w1"))
            )
        ) as router,
        aiohttp.ClientSession() as http,
    ):
        body = {**chat_body(conversation("m", 10, 5)), "model": "junk"}
        result = await post(http, router.url, body)  # one list is known: junk is unknown
        assert result.status == 404
        assert orjson.loads(result.raw)["error"]["code"] == "model_not_found"
        assert (await post(http, router.url, chat_body(conversation("m", 10, 5)))).status == 200
        models = {
            labels["model"]
            for name, labels, _ in await router_samples(http, router)
            if name == "kvrouter_requests_total"
        }
        assert models == {TEST_MODEL}


async def test_only_request_headers_meant_for_the_engine_reach_it() -> None:
    seen: list[dict[str, str]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        await request.json()  # the body the engine gets is the JSON itself
        return whole_reply()

    body = orjson.dumps(chat_body(conversation("h", 10, 5), stream=False))
    sent = {
        "Content-Type": "application/json",
        "Content-Encoding": "gzip",
        "Authorization": "Bearer the-clients-own-key",
        "Cookie": "session=secret",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "X-Request-Id": "req-1",
    }
    async with (
        fake_engine(chat) as url,
        serve_router(router_config([], workers=(WorkerConfig(url, name="w0"),))) as router,
        aiohttp.ClientSession(auto_decompress=False) as http,
        http.post(
            router.url + "/v1/chat/completions",
            data=gzip.compress(body),
            headers=sent,
            skip_auto_headers=("Accept-Encoding",),
        ) as response,
    ):
        assert response.status == 200, await response.text()
    got = {k.lower(): v for k, v in seen[0].items()}
    assert got["traceparent"] == sent["traceparent"] and got["x-request-id"] == "req-1"
    assert got["content-type"] == "application/json"
    for private in ("authorization", "cookie", "content-encoding", "accept-encoding"):
        assert private not in got, private


class _BrokenPolicy(RoundRobinPolicy):
    """A policy with a bug: what the router does with an error nobody expected."""

    def choose(self, request: RouteRequest, candidates: Sequence[WorkerView]) -> Decision:
        raise KeyError("a bug")


async def test_an_unexpected_error_is_a_json_500_and_the_router_goes_on(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 1) as fleet,
        serve_router(router_config(fleet)) as router,
        aiohttp.ClientSession() as http,
    ):
        slot = router.app[STATE_KEY].router.policies
        working = slot.current
        assert slot.install(ActivePolicy("round_robin", {}, working.version + 1, _BrokenPolicy()))
        result = await post(http, router.url, chat_body(conversation("bug", 10, 5)))
        assert result.status == 500 and result.headers["Content-Type"] == "application/json"
        error = orjson.loads(result.raw)["error"]
        assert error["type"] == "server_error" and "a bug" not in error["message"]
        assert slot.install(ActivePolicy(working.name, {}, working.version + 2, working.policy))
        assert (await post(http, router.url, chat_body(conversation("ok", 10, 5)))).status == 200
        await assert_idle(http, router)


async def _never_answers(request: web.Request) -> web.StreamResponse:
    await asyncio.Event().wait()  # answers /health, hangs on every request
    raise AssertionError


async def test_a_worker_that_sends_nothing_is_retried_after_the_first_byte_timeout(
    engine_factory: EngineFactory,
) -> None:
    upstream = UpstreamConfig(first_byte_timeout_s=0.3)
    async with (
        fake_engine(_never_answers) as hung,
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
        for _ in range(2):  # round robin: at least one lands on the hung worker first
            result = await post(http, router.url, chat_body(conversation("fb", 20, 5)))
            assert result.status == 200 and result.worker == "w1"
        assert await metric(http, router, "kvrouter_retries_total", worker="w0") >= 1
        assert await metric(http, router, "kvrouter_requests_total", outcome="success") == 2
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


async def test_the_router_authenticates_to_engines_with_their_api_key(
    engine_factory: EngineFactory,
) -> None:
    async with engine_factory(api_key="engine-key") as sim, aiohttp.ClientSession() as http:
        keyed = router_config([sim], upstream=UpstreamConfig(api_key="engine-key"))
        async with serve_router(keyed) as router:
            async with http.get(router.url + "/v1/models") as response:
                listed = [m["id"] for m in (await response.json())["data"]]
            assert listed == [TEST_MODEL]  # the probe read the engine's model list
            client_key = {"Authorization": "Bearer not-for-the-engine"}
            body = chat_body(conversation("key", 20, 5))
            async with http.post(
                router.url + "/v1/chat/completions", json=body, headers=client_key
            ) as response:
                assert response.status == 200
        async with serve_router(router_config([sim])) as router:
            assert (
                await post(http, router.url, chat_body(conversation("no", 20, 5)))
            ).status == 401


async def test_the_worker_header_and_open_metrics_are_choices(
    engine_factory: EngineFactory,
) -> None:
    """Which worker served (with prefix routing: whether a prompt was cached there) is
    not told unless asked for, and /metrics can want a token."""
    async with engine_factory() as sim, aiohttp.ClientSession() as http:
        quiet = router_config([sim], worker_header=False, metrics_token="m3trics")
        async with serve_router(quiet) as router:
            result = await post(http, router.url, chat_body(conversation("q", 20, 5)))
            assert result.status == 200 and WORKER not in result.headers
            async with http.get(router.url + "/metrics") as response:
                assert response.status == 401
                assert (await response.json())["error"]["type"] == "authentication_error"
            async with http.get(
                router.url + "/metrics", headers={"Authorization": b"Bearer \xff".decode("latin-1")}
            ) as response:
                assert response.status == 401
            async with http.get(
                router.url + "/metrics", headers={"Authorization": "Bearer m3trics"}
            ) as response:
                assert response.status == 200
        async with serve_router(router_config([sim])) as router:
            assert (
                await post(http, router.url, chat_body(conversation("q", 20, 5)))
            ).worker == "w0"


async def test_a_cookie_one_engine_sets_never_reaches_another_request() -> None:
    """The upstream client is shared by every client of the router: it keeps no cookies."""
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Cookie"))
        response = whole_reply()
        response.set_cookie("engine-session", "for-one-client-only")
        return response

    async with fake_engine(chat) as url:
        local = url.replace("127.0.0.1", "localhost")  # a host name: cookies are kept for it
        config = router_config([], workers=(WorkerConfig(local, name="w0"),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            for user in ("first", "second"):
                body = chat_body(conversation(user, 10, 5), stream=False)
                assert (await post(http, router.url, body)).status == 200
    assert seen == [None, None]
