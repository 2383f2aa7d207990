"""What crosses between clients, the router and the engines, and what must not: the
router's API keys, the headers and cookies passed on, the engines' own key, which worker
served, metric labels a client could choose. Real HTTP over loopback to simulated engines
and stand-in workers."""

from __future__ import annotations

import contextlib
import gzip

import aiohttp
import orjson
from aiohttp import web

from router.config import UpstreamConfig, WorkerConfig
from tests.conftest import TEST_MODEL, EngineFactory, router_config, serve_router
from tests.router_client import (
    WORKER,
    chat_body,
    conversation,
    engines,
    fake_engine,
    post,
    router_samples,
    whole_reply,
)


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
        # The engine's own routes the router passes on spend the engine's CPU too.
        for path, payload in (
            ("/tokenize", {"model": TEST_MODEL, "prompt": "hello"}),
            ("/detokenize", {"model": TEST_MODEL, "tokens": [1, 2]}),
        ):
            for headers, status in (({}, 401), ({"Authorization": "Bearer key-one"}, 200)):
                async with http.post(router.url + path, json=payload, headers=headers) as response:
                    assert response.status == status, (path, await response.text())


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
