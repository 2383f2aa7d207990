"""One loop for every request's attempts (router/routing/attempts.py): how many, how spaced, and
passthrough routes on the same eligible workers, the same load and the same breaker as
the keyed ones."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.loopback import serve_on_loopback
from router.clock import monotonic
from router.config import HealthConfig, UpstreamConfig, WorkerConfig
from router.errors import ConfigError
from router.fleet.breaker import BreakerState
from router.routing.attempts import Retry
from tests.conftest import TEST_MODEL, EngineFactory, router_config, serve_router
from tests.router_client import engines

TOKENIZE = {"model": TEST_MODEL, "prompt": "hello"}
# Probes and scrapes far apart: what a test sets on a worker stays until it looks.
QUIET = HealthConfig(interval_s=3600, scrape_interval_s=3600, stale_after_s=7200)


def test_retry_stops_at_its_attempts_and_its_deadline_and_spaces_by_its_backoff() -> None:
    retry = Retry(3, deadline_s=10.0)
    assert retry.backoff() is None
    assert [retry.delay_before_next(n, 1.0, None) for n in (1, 2, 3)] == [0.0, 0.0, None]
    assert retry.delay_before_next(1, 10.5, None) is None  # past the deadline: no more
    spaced = Retry(5, 3.0, backoff_s=0.5)
    backoff = spaced.backoff()
    assert [spaced.delay_before_next(n, 0.0, backoff) for n in (1, 2, 3, 4)] == [0.5, 1, 2, 3]
    assert spaced.delay_before_next(1, 2.9, spaced.backoff()) is None  # it would end too late
    assert Retry.of(UpstreamConfig(retry_backoff_s=0.2)) == Retry(2, 90.0, 0.2)
    for wrong in (-1.0, 91.0):  # a first wait past the deadline would leave no retry
        with pytest.raises(ConfigError, match="retry_backoff_s"):
            UpstreamConfig(retry_backoff_s=wrong)


async def test_a_passthrough_request_goes_to_the_least_loaded_as_the_engines_report_it(
    engine_factory: EngineFactory,
) -> None:
    async with (
        engines(engine_factory, 2) as fleet,
        serve_router(router_config(fleet, health=QUIET)) as router,
        aiohttp.ClientSession() as http,
    ):
        busy = router.state.router.fleet.workers["w0"]
        busy.engine_running, busy.engine_waiting, busy.metrics_at = 6, 4, monotonic()
        router.state.router.fleet.workers["w1"].metrics_at = monotonic()
        for _ in range(3):
            async with http.post(router.url + "/tokenize", json=TOKENIZE) as reply:
                assert reply.status == 200
                assert reply.headers["X-Kvrouter-Worker"] == "w1"


@contextlib.asynccontextmanager
async def failing_tokenizer() -> AsyncIterator[str]:
    """An idle engine by its probes and scrapes that fails every ``/tokenize`` with a 503."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": TEST_MODEL}]})

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": "overloaded"}, status=503)

    async def idle(request: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n")

    app = web.Application()
    app.router.add_get("/metrics", idle)
    app.router.add_get("/health", ok)
    app.router.add_get("/v1/models", ok)
    app.router.add_post("/tokenize", busy)
    async with serve_on_loopback(app) as url:
        yield url


async def test_a_passthrough_worker_that_fails_opens_its_circuit_and_its_requests_go_on(
    engine_factory: EngineFactory,
) -> None:
    async with (
        failing_tokenizer() as broken,
        engines(engine_factory, 1) as fleet,
    ):
        # The broken worker's name sorts first: on equal load it is tried first.
        workers = (WorkerConfig(broken, name="a-broken"), WorkerConfig(fleet[0].url, name="b"))
        health = HealthConfig(interval_s=3600, failure_threshold=2)
        async with (
            serve_router(router_config(fleet, workers=workers, health=health)) as router,
            aiohttp.ClientSession() as http,
        ):
            for _ in range(4):
                async with http.post(router.url + "/tokenize", json=TOKENIZE) as reply:
                    assert reply.status == 200, await reply.text()
                    assert reply.headers["X-Kvrouter-Worker"] == "b"
            worker = router.state.router.fleet.workers["a-broken"]
            assert worker.breaker.state is BreakerState.OPEN
            assert worker.outstanding_requests == 0


async def test_when_every_worker_fails_the_last_ones_own_answer_is_passed_on(
    engine_factory: EngineFactory,
) -> None:
    async with failing_tokenizer() as broken, engines(engine_factory, 1) as fleet:
        workers = (WorkerConfig(broken, name="only"),)
        async with (
            serve_router(router_config(fleet, workers=workers)) as router,
            aiohttp.ClientSession() as http,
            http.post(router.url + "/tokenize", json=TOKENIZE) as reply,
        ):
            assert reply.status == 503
            assert await reply.json() == {"error": "overloaded"}
