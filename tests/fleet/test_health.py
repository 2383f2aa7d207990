"""One worker's odd answers never stop the health prober for the rest of the fleet."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from bench.loopback import serve_on_loopback
from router.config import HealthConfig, WorkerConfig
from router.fleet.health import MAX_PROBE_BODY_BYTES, HealthProber
from router.fleet.workers import Fleet, Worker
from router.index.residency import LocalPrefixIndex
from tests.conftest import EngineFactory, RunningEngine, RunningRouter, router_config, serve_router
from tests.router_client import engines, set_faults, wait_for

FAST_PROBES = HealthConfig(interval_s=0.05, scrape_interval_s=0.05, timeout_s=1.0)
# A proxy's error page in Latin-1, labelled UTF-8.
NOT_UTF8 = "Service indisponible, réessayez".encode("latin-1")
IDLE_METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"


@dataclass(slots=True)
class OddWorker:
    """A stand-in worker whose /health and /metrics answer what the test says."""

    health_status: int = 200
    health_body: bytes = b"ok"
    metrics_body: bytes = IDLE_METRICS
    health_answers: int = 0
    metrics_answers: int = 0

    async def health(self, request: web.Request) -> web.Response:
        self.health_answers += 1
        return web.Response(
            body=self.health_body,
            status=self.health_status,
            content_type="text/plain",
            charset="utf-8",
        )

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_answers += 1
        return web.Response(body=self.metrics_body, content_type="text/plain", charset="utf-8")


@contextlib.asynccontextmanager
async def serve_odd(odd: OddWorker) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/health", odd.health)
    app.router.add_get("/metrics", odd.metrics)
    async with serve_on_loopback(app) as url:
        yield url


def healthy(router: RunningRouter) -> set[str]:
    return {w.name for w in router.state.router.fleet.all() if w.healthy}


async def _healthy_are(router: RunningRouter, expected: set[str]) -> bool:
    return healthy(router) == expected


async def _at_least(value: int, minimum: int) -> bool:
    return value >= minimum


async def _blip(
    http: aiohttp.ClientSession, router: RunningRouter, w0: RunningEngine, others: set[str]
) -> None:
    """w0's /health fails, then passes again: the prober must see both."""
    await set_faults(http, w0, fail_health=True)
    await wait_for(lambda: _healthy_are(router, others))
    await set_faults(http, w0, fail_health=False)
    await wait_for(lambda: _healthy_are(router, others | {"w0"}))


@pytest.mark.parametrize(("status", "odd_healthy"), [(503, False), (200, True)])
async def test_a_non_utf8_health_body_does_not_stop_the_prober(
    engine_factory: EngineFactory, status: int, odd_healthy: bool
) -> None:
    odd = OddWorker(health_status=status, health_body=NOT_UTF8)
    async with (
        engines(engine_factory, 1) as fleet,
        serve_odd(odd) as odd_url,
        aiohttp.ClientSession() as http,
    ):
        workers = (WorkerConfig(fleet[0].url, name="w0"), WorkerConfig(odd_url, name="odd"))
        async with serve_router(router_config([], workers=workers, health=FAST_PROBES)) as router:
            others = {"odd"} if odd_healthy else set()
            assert healthy(router) == {"w0"} | others  # admitted at start
            await _blip(http, router, fleet[0], others)  # and readmitted
            answered = odd.health_answers
            await wait_for(lambda: _at_least(odd.health_answers, answered + 2))


async def test_garbage_metrics_from_one_worker_do_not_stop_the_prober(
    engine_factory: EngineFactory,
) -> None:
    odd = OddWorker()
    async with (
        engines(engine_factory, 1) as fleet,
        serve_odd(odd) as odd_url,
        aiohttp.ClientSession() as http,
    ):
        workers = (WorkerConfig(fleet[0].url, name="w0"), WorkerConfig(odd_url, name="odd"))
        async with serve_router(router_config([], workers=workers, health=FAST_PROBES)) as router:
            worker = router.state.router.fleet.workers["odd"]
            capacity = worker.capacity_tokens
            # Not UTF-8: the lines that are readable still count.
            odd.metrics_body = b"# " + NOT_UTF8 + b"\nvllm:num_requests_running 3\n"
            await wait_for(lambda: _at_least(worker.engine_running, 3))
            odd.metrics_body = (
                b"sglang:max_total_num_tokens +Inf\n{{ 1\nvllm:num_requests_running 4\n"
            )
            await wait_for(lambda: _at_least(worker.engine_running, 4))
            await _blip(http, router, fleet[0], {"odd"})
            assert worker.capacity_tokens == capacity


async def test_an_error_in_one_workers_scrape_spares_the_others(
    engine_factory: EngineFactory,
) -> None:
    restarted: list[str] = []

    def on_restart(worker: Worker) -> None:
        if worker.name == "w1":
            raise RuntimeError("purge failed")
        restarted.append(worker.name)

    async with engines(engine_factory, 2) as sims, aiohttp.ClientSession() as http:
        fleet, index = Fleet(), LocalPrefixIndex()
        for i, sim in enumerate(sims):
            fleet.add(Worker(f"w{i}", sim.url, 50_000))
            index.add_worker(f"w{i}", 1000)
        prober = HealthProber(fleet, index, http, HealthConfig(), 16, set(), on_restart)
        await prober.scrape_all()  # the engines' start times
        for sim in sims:
            async with http.post(sim.url + "/sim/restart") as response:
                assert response.status == 200
        await prober.scrape_all()
        assert restarted == ["w0"]
        assert fleet.workers["w1"].healthy


async def test_an_endless_metrics_body_is_cut_off_not_buffered() -> None:
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        line = b"vllm:num_requests_running 0\n" * 2048
        with contextlib.suppress(ConnectionError):
            while True:  # a worker gone wrong: its /metrics never ends
                await response.write(line)
                sent += len(line)
        return response

    app = web.Application()
    app.router.add_get("/metrics", endless)
    async with serve_on_loopback(app) as url, aiohttp.ClientSession() as http:
        fleet, index = Fleet(), LocalPrefixIndex()
        fleet.add(Worker("w0", url, 50_000))
        index.add_worker("w0", 1000)
        prober = HealthProber(
            fleet, index, http, HealthConfig(timeout_s=5.0), 16, set(), lambda worker: None
        )
        await prober.scrape_all()
        assert fleet.workers["w0"].metrics_at is None  # nothing was learnt from it
        assert sent < 4 * MAX_PROBE_BODY_BYTES  # read up to the limit, then hung up


class _SlowHealth(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        time.sleep(0.1)  # in its own thread: the answer comes while the loop is busy
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _threaded_worker() -> Iterator[str]:
    """A worker answering /health from a thread of its own, off the router's loop."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowHealth)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def _silent_server() -> tuple[asyncio.Server, str]:
    """A worker that accepts connections and never answers (hung)."""

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the prober hangs up
        writer.close()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_probe_that_timed_out_while_the_routers_own_loop_stalled_proves_nothing() -> None:
    # Found (session 5, a router driven past one core): its probes timed out because its
    # own loop was busy, not the workers, and every worker was taken out at once.
    silent, silent_url = await _silent_server()
    with _threaded_worker() as ok_url:
        async with silent, aiohttp.ClientSession() as session:
            await _probe_through_a_stall(session, ok_url, silent_url)


async def _probe_through_a_stall(http: aiohttp.ClientSession, ok_url: str, silent_url: str) -> None:
    """Both workers probed while the loop is blocked, then again with it idle."""
    fleet, index = Fleet(), LocalPrefixIndex()
    fleet.add(Worker("ok", ok_url, 50_000))
    fleet.add(Worker("hung", silent_url, 50_000))
    for name in fleet.workers:
        index.add_worker(name, 1000)
    prober = HealthProber(
        fleet, index, http, HealthConfig(timeout_s=0.3), 16, set(), lambda worker: None
    )
    prober.lag.start()
    try:
        probing = asyncio.create_task(prober.probe_all())
        await asyncio.sleep(0.05)  # both probes are on the wire
        time.sleep(0.6)  # noqa: ASYNC251 (the router's loop, busy: nothing read for 0.6 s)
        await probing
        assert fleet.workers["ok"].healthy
        assert fleet.workers["hung"].healthy  # nothing proven against it either
        await prober.probe_all()  # an idle loop: now the timeout is the worker's
        assert fleet.workers["ok"].healthy
        assert not fleet.workers["hung"].healthy
    finally:
        prober.lag.stop()


async def test_a_dead_worker_is_one_readable_log_line(
    engine_factory: EngineFactory, caplog: pytest.LogCaptureFixture
) -> None:
    # Found: the transition was logged as ClientConnectorError(ConnectionKey(host=...)).
    with socket.socket() as s:  # a port nothing listens on once it is closed
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with engines(engine_factory, 1) as fleet:
        workers = (WorkerConfig(fleet[0].url, name="w0"), WorkerConfig(dead, name="dead"))
        async with serve_router(router_config([], workers=workers, health=FAST_PROBES)) as router:
            await wait_for(lambda: _healthy_are(router, {"w0"}))
    said = [r.getMessage() for r in caplog.records if "worker dead is unhealthy" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert "Cannot connect to host 127.0.0.1" in said[0], said[0]
    assert "ConnectionKey" not in said[0] and "\n" not in said[0], said[0]
