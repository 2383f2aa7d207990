"""The admin API: auth, list, add, remove, drain, migrate."""

from __future__ import annotations

from typing import Any

import aiohttp

from tests.conftest import EngineFactory, RunningRouter, router_config, serve_router
from tests.router_client import (
    chat_body,
    conversation,
    engines,
    held_stream,
    post,
    router_samples,
    wait_for,
)

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def admin(
    http: aiohttp.ClientSession,
    router: RunningRouter,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    async with http.request(
        method, router.url + path, json=body, headers=AUTH if headers is None else headers
    ) as response:
        return response.status, await response.json()


async def test_off_without_a_token_and_refuses_bad_tokens(engine_factory: EngineFactory) -> None:
    async with engines(engine_factory, 1) as fleet, aiohttp.ClientSession() as http:
        async with (
            serve_router(router_config(fleet)) as router,
            http.get(router.url + "/admin/workers", headers=AUTH) as response,
        ):
            assert response.status == 404
        async with serve_router(router_config(fleet, admin_token=TOKEN)) as router:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                status, body = await admin(http, router, "GET", "/admin/workers", headers=headers)
                assert status == 401 and body["error"]["type"] == "authentication_error"
            status, body = await admin(http, router, "GET", "/admin/workers")
            assert status == 200 and [w["name"] for w in body["workers"]] == ["w0"]
            assert body["workers"][0]["healthy"] is True


async def test_add_and_remove_workers(engine_factory: EngineFactory) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet[:1], admin_token=TOKEN, policy="round_robin")) as router,
        aiohttp.ClientSession() as http,
    ):
        status, added = await admin(
            http, router, "POST", "/admin/workers", {"url": fleet[1].url, "name": "extra"}
        )
        assert status == 201 and added["name"] == "extra"
        assert added["capacity_tokens"] == 50_000  # read from the engine's /metrics
        body = chat_body([{"role": "user", "content": "hi"}], max_tokens=2)
        served = {(await post(http, router.url, body)).worker for _ in range(4)}
        assert served == {"w0", "extra"}
        assert (
            await admin(
                http, router, "POST", "/admin/workers", {"url": fleet[1].url, "name": "extra"}
            )
        )[0] == 409
        assert (await admin(http, router, "POST", "/admin/workers", {"url": "ftp://x"}))[0] == 400
        samples = await router_samples(http, router)
        assert any(labels.get("worker") == "extra" for _, labels, _ in samples)
        assert (await admin(http, router, "DELETE", "/admin/workers/extra"))[0] == 200
        served = {(await post(http, router.url, body)).worker for _ in range(4)}
        assert served == {"w0"}
        left = {
            name
            for name, labels, _ in await router_samples(http, router)
            if labels.get("worker") == "extra"
        }
        assert not left  # a removed worker's series go with it
        assert (await admin(http, router, "DELETE", "/admin/workers/extra"))[0] == 404


async def test_drain_finishes_in_flight_and_takes_no_new_requests(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN, policy="least_load")) as router,
        aiohttp.ClientSession() as http,
    ):
        long = chat_body([{"role": "user", "content": "long"}], max_tokens=300)
        async with held_stream(http, router.url, long) as (response, _):
            drained = response.headers["X-Kvrouter-Worker"]
            status, state = await admin(http, router, "POST", f"/admin/workers/{drained}/drain")
            assert status == 200 and state["draining"] and state["outstanding_requests"] == 1
            body = chat_body([{"role": "user", "content": "new"}], max_tokens=2)
            for _ in range(3):
                assert (await post(http, router.url, body)).worker != drained
            rest = await response.read()  # the in-flight request finishes normally
            assert rest.rstrip().endswith(b"data: [DONE]")

        async def drained_out() -> bool:
            _, listing = await admin(http, router, "GET", "/admin/workers")
            return any(
                w["name"] == drained and w["outstanding_requests"] == 0 for w in listing["workers"]
            )

        await wait_for(drained_out)
        await admin(http, router, "DELETE", f"/admin/workers/{drained}/drain")
        body = chat_body([{"role": "user", "content": "back"}], max_tokens=2)
        served = {(await post(http, router.url, body)).worker for _ in range(6)}
        assert drained in served


async def test_migrate_makes_the_next_turn_hit_on_the_new_worker(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN)) as router,
        aiohttp.ClientSession() as http,
    ):
        messages = conversation("migrate", 400, 100)
        first = await post(http, router.url, chat_body(messages, max_tokens=16))
        source = first.worker
        assert source is not None
        target = "w1" if source == "w0" else "w0"
        messages += [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "next"},
        ]
        # The checkpoint is restored on the target engine: replay the same history there.
        target_url = fleet[int(target[1])].url
        await post(http, target_url, chat_body(messages[:-1], max_tokens=1))
        status, moved = await admin(
            http, router, "POST", f"/admin/workers/{source}/migrate", {"to": target}
        )
        assert status == 200 and moved["moved_tokens"] > 0
        after = await post(http, router.url, chat_body(messages, max_tokens=4))
        assert after.worker == target and after.cached > 0
        assert (
            await admin(http, router, "POST", f"/admin/workers/{source}/migrate", {"to": source})
        )[0] == 400


async def test_a_request_that_ends_after_its_worker_left_leaves_no_series_behind(
    engine_factory: EngineFactory,
) -> None:
    # Found: the end of a request in flight when its worker was removed made the
    # worker's series again, scraped for as long as the router ran.
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, admin_token=TOKEN, policy="round_robin")) as router,
        aiohttp.ClientSession() as http,
    ):
        body = {**chat_body([{"role": "user", "content": "hi"}], max_tokens=400), "stream": True}
        async with held_stream(http, router.url, body) as (response, _):
            worker = response.headers["X-Kvrouter-Worker"]
            assert (await admin(http, router, "DELETE", f"/admin/workers/{worker}"))[0] == 200
            await response.read()  # the stream ends on the removed worker
        samples = await router_samples(http, router)
        assert not [labels for _, labels, _ in samples if labels.get("worker") == worker]
