"""``kvrouter bench soak`` for a few seconds, and the router's asyncio task-count metric.

The soak runs as it does from the command line: ``kvrouter serve`` and the simulated
engines as processes, real HTTP on loopback. One run with a restart, a removal and an
outage must lose nothing and count the outage's errors apart; one with the router's
retries turned off must report the requests a failing worker cost as lost (the check
can fail).
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, cast

import aiohttp
import orjson
import pytest
from aiohttp import web
from rich.console import Console

from bench.ports import free_port_run
from bench.soak.faults import FaultEvent, FaultPlan, SoakFleet, _wait_back
from bench.soak.run import SoakConfig, run_soak
from router.config import HealthConfig, WorkerConfig
from router.fleet.workers import Fleet
from router.index.residency import LocalPrefixIndex
from router.observability.loop_metrics import TASKS_METRIC, EventLoopCollector
from router.observability.metrics import RouterMetrics
from tests.conftest import router_config, serve_router
from tests.router_client import assert_idle, chat_body, conversation, fake_engine, metric

ENDINGS_TOTAL = ("ok", "disconnected", "failed_after_first_byte", "failed_before_first_byte")


def soak_config(tmp_path: Path, **overrides: Any) -> SoakConfig:
    base = free_port_run(5)
    values: dict[str, Any] = {
        "engines": 4,
        "clients": 6,
        "think_s": 0.2,
        "base_port": base + 1,
        "router_port": base,
        "out": tmp_path,
        "sample_every_s": 1.0,
    }
    values.update(overrides)
    return SoakConfig(**values)


def _records(out: Path) -> int:
    return len((out / "records.jsonl").read_bytes().splitlines())


class ReportedCircuits:
    """A fleet whose router reports these circuits, one answer a call, the last kept."""

    def __init__(self, *answers: dict[str, str]) -> None:
        self._answers = list(answers)

    async def circuits(self) -> dict[str, str]:
        return self._answers.pop(0) if len(self._answers) > 1 else self._answers[0]


async def test_a_circuit_left_half_open_when_the_traffic_is_done_ends_the_wait() -> None:
    done = asyncio.Event()
    done.set()
    event = FaultEvent("fail", ("w0",), 0.0)
    fleet = cast(SoakFleet, ReportedCircuits({"w0": "half_open"}))
    await asyncio.wait_for(_wait_back(fleet, event, time.monotonic, done), timeout=10)
    assert event.recovered is None
    assert "no request came to try it" in event.note


async def test_while_the_traffic_goes_on_the_wait_is_for_the_circuit_to_close() -> None:
    event = FaultEvent("fail", ("w0",), 0.0)
    answers = ({"w0": "open"}, {"w0": "half_open"}, {"w0": "closed"})
    fleet = cast(SoakFleet, ReportedCircuits(*answers))
    await asyncio.wait_for(_wait_back(fleet, event, time.monotonic, asyncio.Event()), timeout=10)
    assert event.serving is not None and event.recovered is not None
    assert event.note == ""


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_soak_with_restarts_and_an_outage_loses_nothing(tmp_path: Path) -> None:
    plan = FaultPlan(
        kinds=("restart", "remove"),
        every_s=2.0,
        duration_s=3.0,
        first_at_s=2.0,
        outage_every_s=12.0,
        outage_s=2.0,
    )
    config = soak_config(tmp_path, duration_s=25.0, warmup_s=8.0, faults=plan)
    summary = await run_soak(config, Console(file=io.StringIO()))

    requests = summary["requests"]
    # Every request sent is in exactly one ending, and on disk.
    assert requests["sent"] == sum(requests["by_ending"].values()) == _records(tmp_path)
    assert set(requests["by_ending"]) == set(ENDINGS_TOTAL)
    assert requests["by_ending"]["ok"] > 20
    kinds = {e["kind"]: e for e in summary["fault_events"]}
    assert {"restart", "remove", "outage"} <= set(kinds)
    assert all(e["recovered"] is not None for e in summary["fault_events"]), kinds
    assert summary["router_counters"]["worker_restarts_seen"] >= 1

    # Nothing lost while a worker could serve; while none could, a clear error status.
    assert requests["lost_before_first_byte"] == 0, requests["lost"]
    assert requests["no_worker_could_serve"] > 0
    assert set(requests["no_worker_statuses"]) <= {"502", "503", "504"}
    outage = kinds["outage"]
    for example in requests["no_worker_examples"]:
        assert example["started"] <= outage["serving"] and outage["started"] <= example["ended"]

    # The task count is read from the router process itself, and nothing grew.
    assert all(s["tasks"] is not None and s["tasks"] > 0 for s in summary["samples"])
    checks = summary["checks"]
    assert checks["tasks_no_growth"] and checks["fds_no_growth"], summary["process"]
    assert checks["load_back_to_zero"]
    assert summary["process"]["rss_bytes"]["end"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_without_retries_a_failing_worker_costs_lost_requests(tmp_path: Path) -> None:
    plan = FaultPlan(kinds=("fail",), every_s=1.0, duration_s=4.0, first_at_s=2.0, outage_every_s=0)
    config = soak_config(
        tmp_path,
        duration_s=9.0,
        warmup_s=2.0,
        faults=plan,
        max_attempts=1,
        policy="round_robin",
    )
    summary = await run_soak(config, Console(file=io.StringIO()))

    requests = summary["requests"]
    assert requests["lost_before_first_byte"] > 0
    assert requests["no_worker_could_serve"] == 0
    failed = summary["fault_events"][0]
    for lost in requests["lost"]:
        assert lost["status"] == 500  # the engine's own answer, passed on unretried
        assert f"fail {failed['workers'][0]}" in lost["during"]
    assert summary["checks"]["no_lost_requests"] is False
    assert summary["passed"] is False
    # Idle again, the router holds no more descriptors than idle before (the sampler's
    # own connection in both counts).
    idle = [s for s in summary["samples"] if s["phase"].startswith("idle")]
    assert idle[-1]["fds"] <= idle[0]["fds"], idle


async def test_the_task_metric_counts_the_loops_tasks() -> None:
    # No probe or scrape round during the test: its tasks would come and go.
    quiet = HealthConfig(interval_s=60.0, scrape_interval_s=30.0, stale_after_s=60.0)
    config = router_config([], health=quiet)
    async with serve_router(config) as router, aiohttp.ClientSession() as http:
        idle = await metric(http, router, TASKS_METRIC)
        assert idle > 0
        release = asyncio.Event()
        waiting = [asyncio.create_task(release.wait()) for _ in range(5)]
        assert await metric(http, router, TASKS_METRIC) == idle + 5
        release.set()
        await asyncio.gather(*waiting)
        assert await metric(http, router, TASKS_METRIC) == idle


def test_metrics_built_off_a_loop_report_no_task_count() -> None:
    fleet, index = Fleet(), LocalPrefixIndex()
    assert b"kvrouter_event_loop_tasks" not in RouterMetrics(fleet, index, 64).render()
    assert list(EventLoopCollector(None).collect()) == []


# -- found by the soak ---------------------------------------------------------------------

SSE_CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "word "}}]}\n\n'


def _hold_the_loop(seconds: float) -> None:
    """Blocks the event loop (the engine's, the router's and this test's): whatever
    reaches a socket meanwhile is seen in one poll, in the order it arrived."""
    time.sleep(seconds)


async def test_a_client_gone_between_two_chunks_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The client goes away while the router has the next chunk in hand: the router's
    transport is closing, aiohttp has not yet called connection_lost (which cancels the
    handler), so the write raises. That is a client disconnect, not an error to log."""
    caplog.set_level(logging.ERROR, logger="aiohttp.server")
    first_read = asyncio.Event()
    client_gone = threading.Event()
    loop = asyncio.get_running_loop()

    async def engine(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(SSE_CHUNK)
        await first_read.wait()
        await response.write(SSE_CHUNK)  # on the router's upstream socket now
        client_gone.set()
        _hold_the_loop(0.3)  # the client closes meanwhile: both are ready in one poll
        await response.write(b"data: [DONE]\n\n")
        return response

    def client(host: str, port: int, body: bytes) -> None:
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        with socket.create_connection((host, port)) as sock:
            sock.sendall(head + body)
            seen = b""
            while b"word" not in seen:
                seen += sock.recv(65536)
            loop.call_soon_threadsafe(first_read.set)
            client_gone.wait(5)

    async with fake_engine(engine) as url:
        config = router_config([], workers=(WorkerConfig(url, name="w0"),))
        async with serve_router(config) as router, aiohttp.ClientSession() as http:
            host, port = router.url.removeprefix("http://").split(":")
            body = orjson.dumps(chat_body(conversation("gone", 50, 10)))
            await asyncio.to_thread(client, host, int(port), body)
            await assert_idle(http, router, wait_s=2.0)
            disconnects = await metric(
                http, router, "kvrouter_requests_total", outcome="client_disconnect"
            )
    assert disconnects == 1
    errors = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert [r.getMessage() for r in errors] == []
